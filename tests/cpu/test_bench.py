"""The benchmark (tools/bench.py and its library modules) runs end to end (on CPU it times
the fallback) and writes its results file; the numbers themselves are only meaningful on
a Hopper GPU."""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import subprocess
import sys

import bench
import bench_cases
import bench_protocol
import bench_report
import jax
import jax.numpy as jnp
import pytest

from jax_hopper import _ffi

REPO = pathlib.Path(__file__).resolve().parents[2]
# The smallest protocol that still takes every path: one sample, a mirrored pair of rounds.
FAST = ["--no-torch", "--samples", "1", "--rounds", "2", "--sustained-seconds", "0.001"]


def module_state():
    """Each benchmark module's globals, by identity (less Python's own, such as the warning
    registry): a run must rebind none of them."""
    return {m.__name__: {k: id(v) for k, v in vars(m).items() if not k.startswith("__")}
            for m in (bench, bench_cases, bench_protocol, bench_report)}


@pytest.mark.slow
def test_bench_writes_rows_for_every_case_and_variant(tmp_path):
    out = tmp_path / "bench.json"
    tp = len(jax.devices()) >= 2  # the tensor-parallel block needs two devices of the default platform
    before = module_state()
    bench.main(["--shapes", "64,32x48x40", "--layouts", "nn,nt", "--batched", "2x32x16x24", "--mlp", "48x32x64",
                "--dense", "48x32x64", "--lm-head", "16x32x72", "--chain", "32", "--chain-length", "2",
                "--json", str(out)] + FAST + (["--tp-mlp", "32x16x64"] if tp else []))
    assert module_state() == before
    data = json.loads(out.read_text())
    rows = data["rows"]
    cases = {(r["batch"], r["m"], r["n"], r["k"], r["layout"]) for r in rows}
    # 2 shapes x 2 layouts, 1 batched, the MLP block (forward, training step through dense
    # and through mlp, the auto/z1-kept A/B, the backward form with and without db1, the
    # forward's four parts), one dense layer, the LM head's loss and step, one chain,
    # (1 tensor-parallel block)
    assert len(cases) == 4 + 1 + 15 + 1 + 2 + 1 + tp
    assert {r["layout"] for r in rows if r["layout"].startswith("mlp")} == {
        f"mlp {step} [gelu_tanh]" for step in bench_cases.MLP_STEPS}
    assert len(bench_cases.MLP_STEPS) == 15
    assert {r["variant"] for r in rows} >= {"jax_hopper", "jnp.dot", "V5 s=4", "jax_hopper auto", "jnp"}
    assert {r["mode"] for r in rows} == {"products", "mlp", "dense", "lm head", "chain"} | ({"tp-mlp"} if tp else set())
    fields = {"kernel_ms", "kernel_tflops", "kernel_ratio_vs_jnp", "kernel_spread_ms", "sustained_ms",
              "sustained_tflops", "sustained_ratio_vs_jnp", "sustained_rounds_ms", "rel_error", "input_sets",
              "variant", "batch", "m", "n", "k", "layout", "dtype", "clock"}
    assert all(fields <= set(r) for r in rows)
    assert all({"path", "rule", "kind"} <= set(r) for r in rows if r["mode"] == "products")
    assert all({"kernel_us_per_product", "sustained_us_per_product"} <= set(r) for r in rows if r["mode"] == "chain")
    assert all(r["kernel_ms"] > 0 and r["sustained_ms"] > 0 for r in rows)
    assert all(len(r["sustained_rounds_ms"]) == 2 for r in rows)
    assert all(r["rel_error"] < 1e-2 for r in rows if r["rel_error"] is not None)
    assert data["geometric_means"]["cases"] == 5


def test_results_file_says_which_gpu_when_commit_and_protocol(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--shapes", "32x48x40", "--stages=", "--json", str(out)] + FAST
    bench.main(args + ["--commit", "abc1234"])
    meta = json.loads(out.read_text())["meta"]
    assert meta["gpu"] == jax.devices()[0].device_kind and meta["jax"] == jax.__version__
    assert meta["commit"] == "abc1234"
    assert meta["date"].endswith("+00:00")  # UTC, ISO 8601
    assert meta["command"].startswith("tools/bench.py --shapes 32x48x40") and meta["argv"][:2] == args[:2]
    protocol = meta["protocol"]
    assert protocol["kernel_samples"] == 1 and protocol["sustained_rounds"] == 2
    assert protocol["sustained_settle_rounds"] == 1 and protocol["kernel_time_l2"] == "warm"
    assert protocol["sustained_order"] == "mirrored pairs, rotated" and protocol["sustained_statistic"] == "mean"
    # Without --commit: git's HEAD of the repository the tool sits in, else "unknown".
    bench.main(args)
    commit = json.loads(out.read_text())["meta"]["commit"]
    assert commit == bench_report.commit_of(REPO) and commit
    assert bench_report.commit_of(pathlib.Path("/")) == "unknown"
    # The tables land on stdout whatever it is (here not a terminal), the summary too.
    printed = capsys.readouterr().out
    assert "kernel ms" in printed and "\nsummary\n" in printed and "geometric mean over 1 product cases" in printed


def test_bench_refuses_to_time_the_fallback_on_a_gpu(monkeypatch):
    # On a GPU without our extension (a repository checkout imports jax_hopper from the
    # source tree) every "kernel" row would be XLA's dot: the benchmark must stop.
    class FakeGpu:
        platform, device_kind = "gpu", "fake GPU"

    monkeypatch.setattr(bench.jax, "devices", lambda *a: [FakeGpu()])
    monkeypatch.setattr(bench.jax_hopper, "kernel_available", lambda: False)
    with pytest.raises(SystemExit, match="would time XLA's dot under our name"):
        bench.main(["--shapes", "64", "--no-torch"])


def test_cli_runs_from_anywhere_with_the_installed_package(tmp_path):
    # As a script from another directory, and with the repository root on PYTHONPATH (the
    # source tree, which has no extension, must not shadow the installed package).
    import jax_hopper

    site = str(pathlib.Path(jax_hopper.__file__).resolve().parents[1])
    out = tmp_path / "b.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), site])}
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "bench.py"), "--shapes", "32", "--stages=",
                           "--json", str(out)] + FAST, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(out.read_text())["meta"]
    assert pathlib.Path(meta["jax_hopper"]["file"]).resolve().parents[1] != REPO
    assert "summary" in proc.stdout and "[1/1] 32x32x32 NN f16" in proc.stderr  # a line per case in a log


def test_kernels_and_stages_only_where_compiled(capsys):
    p = argparse.ArgumentParser()

    def ask(build, stages=None, kernels=""):
        said = []
        got = bench.extras(argparse.Namespace(stages=stages, kernels=kernels), build, ["f16"], p, said.append)
        return got, said

    default = bench_cases.Build(bench_cases.default_instances())
    assert ask(default, kernels="small_m") == (([4], ["small_m"]), [])
    assert "persistent_basic" not in default.extra_kinds() and "small_m" in default.extra_kinds()
    for stages, kernels in (("2", ""), ("4", "persistent_basic")):  # experimental: behind the CMake option
        with pytest.raises(SystemExit):
            ask(default, stages, kernels)
        assert "-DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ask(default, kernels="no_such_kind")
    assert "unknown --kernels ['no_such_kind']" in capsys.readouterr().err
    experimental = bench_cases.Build(default.instances | {("v5", "f16", "K", "MN", 2)})
    assert ask(experimental, stages="2,4") == (([2, 4], []), [])
    # Nothing known to be compiled: the default depth is left out with a note; asked for, an error.
    none = bench_cases.Build(frozenset(), "this build's extension does not list its compiled instances")
    (stages, kernels), said = ask(none)
    assert (stages, kernels) == ([], []) and "V5 s=4 not timed" in said[0]
    with pytest.raises(SystemExit):
        ask(none, stages="4")
    assert "does not list its compiled instances" in capsys.readouterr().err


def test_build_reads_the_extensions_list(monkeypatch):
    from jax_hopper import _kernels

    def missing():  # an extension built before it listed its instances
        raise AttributeError("module 'jax_hopper._jax_hopper' has no attribute 'compiled_instances'")

    monkeypatch.setattr(_ffi, "compiled_instances", missing)
    monkeypatch.setattr(_ffi, "kernel_available", lambda: True)
    on_gpu = bench_cases.Build.current("gpu")
    assert on_gpu.instances == frozenset() and "does not list" in on_gpu.note
    on_cpu = bench_cases.Build.current("cpu")  # the rows time XLA's dot: a default build stands in
    assert on_cpu.instances == bench_cases.default_instances() and "no GPU" in on_cpu.note
    listed = frozenset({("small_m", _kernels.Instance("bf16", "K", "MN", 4))})
    monkeypatch.setattr(_ffi, "compiled_instances", lambda: listed)
    build = bench_cases.Build.current("gpu")
    assert build.note is None and build.extra_kinds() == ["small_m"] and build.has("small_m", "bf16")
    assert not build.has("small_m", "f16")


def test_breakdown_names_our_kernels_by_kind():
    # CUPTI reports our kernel by its mangled name; --breakdown shows its kind number.
    mangled = ("_ZN10jax_hopper11gemm_kernelINS_10GemmConfigILNS_10KernelKindE11E6__halfLNS_5MajorE0ELS4_1ELi4EEEEEv"
               "14CUtensorMap_stS6_S6_NS_12OutputParamsE")
    short = bench_protocol.short_kernel_name
    assert short(mangled) == "jax_hopper gemm_kernel kind 11"
    assert short("nvjet_sm90_hsh_256x128_64x4_1x2_h_bx_coopA_bias_NNT") == \
        "nvjet_sm90_hsh_256x128_64x4_1x2_h_bx_coopA_bias_NNT"
    assert len(short("x" * 200)) == 72


def test_breakdown_only_where_cupti_times_kernels(capsys):
    bench.main(["--shapes=", "--mlp", "48x32x64", "--mlp-steps", "x@W1 no epilogue", "--breakdown"] + FAST)
    # On a GPU each variant's kernels are listed; on CPU (wall clock) there is nothing to list.
    listed = "kernels of mlp x@W1 no epilogue [gelu_tanh] f16" in capsys.readouterr().out
    assert listed == (jax.devices()[0].platform == "gpu")
    assert not bench_protocol.Protocol().breakdown  # the flag lives in the run's protocol, not a global


def test_tables_go_to_the_current_stdout(monkeypatch):
    # A console bound to sys.stdout at creation would write past a later redirection.
    out = bench_report.console()
    captured = io.StringIO()
    monkeypatch.setattr(sys, "stdout", captured)
    bench_report.print_breakdown(out, [{"layout": "step", "dtype": "f16", "variant": "jnp",
                                        "kernels": [("kernel", 1.0)]}])
    bench_report.print_rows(out, [{"batch": 0, "m": 8, "n": 8, "k": 8, "layout": "mlp x [gelu_tanh]",
                                   "dtype": "f16", "variant": "jnp", "kernel_ms": 1.0, "kernel_tflops": 1.0,
                                   "kernel_ratio_vs_jnp": 1.0, "sustained_ms": 1.0, "sustained_tflops": 1.0,
                                   "sustained_ratio_vs_jnp": 1.0, "rel_error": None, "path": None, "rule": None}])
    text = captured.getvalue()
    assert "kernels of step f16" in text and "kernel ms" in text
    assert "[GELU_TANH]" in text  # brackets are text, not rich markup
    assert max(map(len, text.splitlines())) <= bench_report.LOG_WIDTH


def test_geometric_means_cover_product_cases_and_our_kernel_forced(capsys):
    def row(m, variant, kernel, sustained, layout="nn"):
        return {"batch": 0, "m": m, "n": 8, "k": 8, "layout": layout, "dtype": "f16", "variant": variant,
                "kernel_ratio_vs_jnp": kernel, "sustained_ratio_vs_jnp": sustained}

    rows = [row(8, "jax_hopper", 2.0, 1.0), row(8, "jnp.dot", 1.0, 1.0),  # the dispatcher ran our kernel
            row(16, "jax_hopper", 0.5, 1.0), row(16, "kernel small_m", 0.25, 4.0), row(16, "jnp.dot", 1.0, 1.0),
            row(8, "jax_hopper", 100.0, 100.0, layout="mlp train [gelu_tanh]")]  # a step, not a product
    g = bench_report.geometric_means(rows)
    assert g["cases"] == 2
    assert g["jax_hopper"]["kernel"] == pytest.approx(1.0) and g["jax_hopper"]["sustained"] == pytest.approx(1.0)
    assert g["jax_hopper"]["min"] == {"kernel": 0.5, "sustained": 1.0}
    assert g["kernel"]["kernel"] == pytest.approx(0.5**0.5) and g["kernel"]["sustained"] == pytest.approx(2.0)
    bench_report.print_geometric_means(bench_report.console(), rows)
    assert "geometric mean over 2 product cases" in capsys.readouterr().out
    assert bench_report.geometric_means(rows[-1:]) is None


def test_sustained_rounds_mirror_and_rotate_the_order():
    # An untimed round first (the chip settles under load after the kernel-time samples),
    # then rounds in mirrored pairs, rotated from pair to pair: every variant gets one
    # time per round, every variant's places in the order add up to the same number over
    # each pair, and each variant follows every other variant as often as it precedes it.
    order = []
    timers = {name: (lambda name=name: order.append(name) or float(len(order))) for name in "abc"}
    rounds = []
    times = bench_protocol.sustained_rounds(timers, rounds=4, settle=1, progress=lambda: rounds.append(list(order)))
    assert order == ["a", "b", "c"] + ["a", "b", "c", "c", "b", "a", "b", "c", "a", "a", "c", "b"]
    assert len(rounds) == 4
    assert times == {"a": [4.0, 9.0, 12.0, 13.0], "b": [5.0, 8.0, 10.0, 15.0], "c": [6.0, 7.0, 11.0, 14.0]}
    # A clock that drifts linearly (here: time = place in the sequence) moves every
    # variant's mean alike, so identical variants read identical means.
    assert len(set(bench_protocol.sustained_mean(times).values())) == 1


def test_runner_times_each_variant_and_reports_progress():
    # The protocol's counts reach the timings: one warm-up and `kernel_samples` samples per
    # variant, `sustained_rounds` rounds after the settling ones; progress announces as
    # many steps as it then advances.
    class Count(bench_protocol.Progress):
        expected = advanced = 0

        def expect(self, steps):
            self.expected += steps

        def advance(self):
            self.advanced += 1

    progress = Count()
    protocol = bench_protocol.Protocol(kernel_samples=3, sustained_rounds=2, sustained_seconds=0.001)
    runner = bench_protocol.Runner(protocol, progress)
    a = jnp.ones((8, 8))
    variants = [runner.variant(name, jnp.dot) for name in ("ours", "jnp")]
    timings = runner.time(variants, {v.name: [(a, a)] for v in variants})
    assert {len(ts) for ts in timings.kernel.values()} == {3}
    assert {len(ts) for ts in timings.sustained.values()} == {2}
    assert progress.expected == progress.advanced == 5
    fields = timings.fields("ours", 1e9, "jnp")
    assert fields["kernel_ratio_vs_jnp"] == timings.kernel_median["jnp"] / timings.kernel_median["ours"]
    with pytest.raises(ValueError):
        bench_protocol.Protocol(kernel_time_l2="lukewarm")


def test_cold_l2_scrub_runs_first_and_is_left_out_of_the_time():
    # profiler.measure times a call right after an untimed one on the same inputs, so
    # --l2 cold dispatches a read of a buffer twice the size of L2 before each product:
    # as a call of its own (the stream orders it first; measure must take the wrapper for
    # a jitted function, or it would jit both into one program), giving fn's own result;
    # the scrub's kernels (leading, named as measure listed the scrub alone) must not count.
    a = jnp.arange(12.0).reshape(3, 4)
    b = jnp.ones((4, 2))
    scrubbed = bench_protocol.AfterL2Scrub(jnp.dot, bench_protocol.L2Scrub(1024))
    assert isinstance(scrubbed, jax.stages.Wrapped)
    assert (scrubbed(a, b) == jnp.dot(a, b)).all()
    assert "dot_general" in scrubbed.lower(a, b).as_text()

    scrub = ("input_reduce_fusion", "loop_reduce_fusion")
    timings = [(scrub[0], 0.03), (scrub[1], 0.001), ("gemm_fusion_dot", 0.01), ("loop_reduce_fusion", 0.002)]
    assert bench_protocol.without_l2_scrub(timings, scrub) == timings[2:]
    with pytest.raises(RuntimeError, match="not the L2 scrub"):
        bench_protocol.without_l2_scrub(timings[1:], scrub)
    with pytest.raises(RuntimeError, match="not the L2 scrub"):
        bench_protocol.without_l2_scrub(timings, ())


def test_cold_kernel_time_leaves_out_the_learned_scrub_kernels():
    # The scrub's kernel names are learned once, by timing the scrub alone; each cold
    # call's time is then the rest. A call whose first kernels are not the scrub's is an
    # error, not a time (it would count the scrub, or drop the product's own kernels).
    scrub = [("input_reduce_fusion", 0.03), ("input_reduce_fusion_1", 0.001)]
    learned = []

    class FakeProfiler:
        @staticmethod
        def measure(fn, aggregate=True):
            assert fn is bench_protocol.read_l2_scrub and aggregate is False
            return lambda *args: (learned.append(args) or None, scrub)

    a = jnp.ones((4, 4))
    state = bench_protocol.L2Scrub(1024)
    v = bench_protocol.JaxVariant("ours", lambda x, y: x @ y, scrub=state)
    v._profiler = FakeProfiler
    v._measure = lambda *args: (None, scrub + [("gemm_fusion_dot", 0.25), ("loop_reduce_fusion", 0.05)])
    assert v.kernel_ms(a, a) == pytest.approx(0.30)
    assert v.kernel_ms(a, a) == pytest.approx(0.30)
    assert len(learned) == 1 and state.kernels == tuple(name for name, _ in scrub)
    v._measure = lambda *args: (None, [("gemm_fusion_dot", 0.25)])
    with pytest.raises(RuntimeError, match="--l2 cold"):
        v.kernel_ms(a, a)


def test_cold_l2_scrub_only_reads():
    # A scrub that wrote its buffer would leave L2 full of dirty lines, written back to
    # DRAM under the timed kernel: the program must write nothing but its one word.
    protocol = bench_protocol.Protocol()
    buf = bench_protocol.L2Scrub(protocol.l2_scrub_bytes).buffer()
    assert buf.nbytes >= 2 * protocol.l2_bytes
    out = bench_protocol.read_l2_scrub(buf)
    assert out.shape == () and out.dtype == buf.dtype and int(out) == 0
    hlo = bench_protocol.read_l2_scrub.lower(buf).as_text()
    assert "reduce" in hlo and "xor" in hlo


def test_cold_l2_is_recorded_in_the_json(tmp_path):
    out = tmp_path / "bench.json"
    bench.main(["--shapes", "32x48x40", "--stages", "", "--l2", "cold", "--json", str(out)] + FAST)
    data = json.loads(out.read_text())
    assert data["meta"]["protocol"]["kernel_time_l2"] == "cold"
    assert all(r["kernel_ms"] > 0 for r in data["rows"])
