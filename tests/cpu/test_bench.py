"""The benchmark entry point runs end to end (on CPU it times the fallback) and writes
its JSON; the numbers themselves are only meaningful on a Hopper GPU."""

from __future__ import annotations

import json

import jax
import pytest

from jax_hopper import bench


def test_bench_writes_rows_for_every_case_and_variant(tmp_path):
    out = tmp_path / "bench.json"
    tp = len(jax.devices()) >= 2  # the tensor-parallel block needs two devices of the default platform
    bench.main(["--shapes", "64,32x48x40", "--layouts", "nn,nt", "--batched", "2x32x16x24", "--no-torch",
                "--mlp", "48x32x64", "--json", str(out)] + (["--tp-mlp", "32x16x64"] if tp else []))
    rows = json.loads(out.read_text())["rows"]
    cases = {(r["batch"], r["m"], r["n"], r["k"], r["layout"]) for r in rows}
    # 2 shapes x 2 layouts, 1 batched, the MLP block (forward, training step through dense
    # and through mlp, the auto/z1-kept A/B, the backward form with and without db1, the
    # forward's four parts), (1 tensor-parallel block)
    assert len(cases) == 4 + 1 + 15 + tp
    assert {r["layout"] for r in rows if r["layout"].startswith("mlp")} == {
        f"mlp {step} [gelu_tanh]" for step in ("forward", "train", "train mlp op", "train mlp op with dx",
                                               "train mlp op saved act'", "train mlp op auto vs z1 kept",
                                               "dz1 times saved act'", "dz1 backward form",
                                               "dz1 and db1 times saved act'", "dz1 and db1 backward form",
                                               "dense1 act and act'", "dense1 bias+act", "dense2 bias+resid",
                                               "x@W1 no epilogue", "h@W2 no epilogue")}
    assert {r["variant"] for r in rows} >= {"jax_hopper", "jnp.dot", "V5 s=4"}
    assert all(r["kernel_ms"] > 0 and r["sustained_ms"] > 0 for r in rows)
    assert all(r["rel_error"] < 1e-2 for r in rows if r["rel_error"] is not None)


def test_bench_refuses_to_time_the_fallback_on_a_gpu(monkeypatch):
    # On a GPU without our extension (a repository checkout imports jax_hopper from the
    # source tree) every "kernel" row would be XLA's dot: the benchmark must stop.
    class FakeGpu:
        platform, device_kind = "gpu", "fake GPU"

    monkeypatch.setattr(bench.jax, "devices", lambda *a: [FakeGpu()])
    monkeypatch.setattr(bench.jax_hopper, "kernel_available", lambda: False)
    with pytest.raises(SystemExit, match="would time XLA's dot under our name"):
        bench.main(["--shapes", "64", "--no-torch"])


def test_breakdown_names_our_kernels_by_kind():
    # CUPTI reports our kernel by its mangled name; --breakdown shows its kind number.
    mangled = ("_ZN10jax_hopper11gemm_kernelINS_10GemmConfigILNS_10KernelKindE11E6__halfLNS_5MajorE0ELS4_1ELi4EEEEEv"
               "14CUtensorMap_stS6_S6_NS_12OutputParamsE")
    assert bench.short_kernel_name(mangled) == "jax_hopper gemm_kernel kind 11"
    assert bench.short_kernel_name("nvjet_sm90_hsh_256x128_64x4_1x2_h_bx_coopA_bias_NNT") == \
        "nvjet_sm90_hsh_256x128_64x4_1x2_h_bx_coopA_bias_NNT"
    assert len(bench.short_kernel_name("x" * 200)) == 72


def test_breakdown_only_where_cupti_times_kernels(capsys, monkeypatch):
    # main() sets the protocol's globals from its flags: restore them afterwards.
    for name in ("BREAKDOWN", "KERNEL_SAMPLES", "SUSTAINED_ROUNDS"):
        monkeypatch.setattr(bench, name, getattr(bench, name))
    bench.main(["--shapes=", "--no-torch", "--mlp", "48x32x64", "--mlp-steps", "train mlp op", "--samples", "1",
                "--rounds", "1", "--breakdown"])
    # On a GPU each variant's kernels are listed; on CPU (wall clock) there is nothing to list.
    listed = "kernels of mlp train mlp op [gelu_tanh]" in capsys.readouterr().out
    assert listed == (jax.devices()[0].platform == "gpu")


def test_tables_go_to_the_current_stdout(capsys):
    # A default of sys.stdout bound at import time wrote past a later redirection (pytest's
    # capsys): on the H200 the breakdown test above saw no listing for that reason.
    bench.print_breakdown("step", {"jnp": [("kernel", 1.0)]})
    bench.print_table([{"batch": 0, "m": 8, "n": 8, "k": 8, "layout": "nn", "dtype": "f16", "variant": "jnp",
                        "kernel_ms": 1.0, "kernel_tflops": 1.0, "kernel_ratio_vs_jnp": 1.0, "sustained_ms": 1.0,
                        "sustained_tflops": 1.0, "sustained_ratio_vs_jnp": 1.0, "rel_error": None, "path": None,
                        "rule": None}])
    out = capsys.readouterr().out
    assert "kernels of step" in out and "jnp" in out and "kernel ms" in out


def test_geometric_means_cover_product_cases_and_our_kernel_forced(capsys):
    def row(m, variant, kernel, sustained, layout="nn"):
        return {"batch": 0, "m": m, "n": 8, "k": 8, "layout": layout, "dtype": "f16", "variant": variant,
                "kernel_ratio_vs_jnp": kernel, "sustained_ratio_vs_jnp": sustained}

    rows = [row(8, "jax_hopper", 2.0, 1.0), row(8, "jnp.dot", 1.0, 1.0),  # the dispatcher ran our kernel
            row(16, "jax_hopper", 0.5, 1.0), row(16, "kernel small_m", 0.25, 4.0), row(16, "jnp.dot", 1.0, 1.0),
            row(8, "jax_hopper", 100.0, 100.0, layout="mlp train [gelu_tanh]")]  # a step, not a product
    g = bench.geometric_means(rows)
    assert g["cases"] == 2
    assert g["jax_hopper"]["kernel"] == pytest.approx(1.0) and g["jax_hopper"]["sustained"] == pytest.approx(1.0)
    assert g["jax_hopper"]["min"] == {"kernel": 0.5, "sustained": 1.0}
    assert g["kernel"]["kernel"] == pytest.approx(0.5**0.5) and g["kernel"]["sustained"] == pytest.approx(2.0)
    bench.print_geometric_means(rows)
    assert "geometric mean over 2 product cases" in capsys.readouterr().out
    assert bench.geometric_means(rows[-1:]) is None


def test_sustained_rounds_mirror_and_rotate_the_order(monkeypatch):
    # An untimed round first (the chip settles under load after the kernel-time samples),
    # then rounds in mirrored pairs, rotated from pair to pair: every variant gets one
    # time per round, every variant's places in the order add up to the same number over
    # each pair, and each variant follows every other variant as often as it precedes it.
    monkeypatch.setattr(bench, "SUSTAINED_ROUNDS", 4)
    monkeypatch.setattr(bench, "SUSTAINED_SETTLE_ROUNDS", 1)
    order = []
    timers = {name: (lambda name=name: order.append(name) or float(len(order))) for name in "abc"}
    rounds = []
    times = bench.sustained_rounds(timers, progress=lambda: rounds.append(list(order)))
    assert order == ["a", "b", "c"] + ["a", "b", "c", "c", "b", "a", "b", "c", "a", "a", "c", "b"]
    assert len(rounds) == 4
    assert times == {"a": [4.0, 9.0, 12.0, 13.0], "b": [5.0, 8.0, 10.0, 15.0], "c": [6.0, 7.0, 11.0, 14.0]}
    # A clock that drifts linearly (here: time = place in the sequence) moves every
    # variant's mean alike, so identical variants read identical means.
    assert len(set(bench.sustained_mean(times).values())) == 1


def test_cold_l2_scrub_runs_first_and_is_left_out_of_the_time():
    # profiler.measure times a call right after an untimed one on the same inputs, so
    # --l2 cold dispatches a read of a buffer twice the size of L2 before each product:
    # as a call of its own (the stream orders it first; measure must take the wrapper for
    # a jitted function, or it would jit both into one program), giving fn's own result;
    # the scrub's kernels (leading, named as measure listed the scrub alone) must not count.
    import jax.numpy as jnp

    a = jnp.arange(12.0).reshape(3, 4)
    b = jnp.ones((4, 2))
    scrubbed = bench.AfterL2Scrub(jnp.dot)
    assert isinstance(scrubbed, jax.stages.Wrapped)
    assert (scrubbed(a, b) == jnp.dot(a, b)).all()
    assert "dot_general" in scrubbed.lower(a, b).as_text()

    scrub = ("input_reduce_fusion", "loop_reduce_fusion")
    timings = [(scrub[0], 0.03), (scrub[1], 0.001), ("gemm_fusion_dot", 0.01), ("loop_reduce_fusion", 0.002)]
    assert bench.without_l2_scrub(timings, scrub) == timings[2:]
    with pytest.raises(RuntimeError, match="not the L2 scrub"):
        bench.without_l2_scrub(timings[1:], scrub)
    with pytest.raises(RuntimeError, match="not the L2 scrub"):
        bench.without_l2_scrub(timings, ())


def test_cold_kernel_time_leaves_out_the_learned_scrub_kernels(monkeypatch):
    # The scrub's kernel names are learned once, by timing the scrub alone; each cold
    # call's time is then the rest. A call whose first kernels are not the scrub's is an
    # error, not a time (it would count the scrub, or drop the product's own kernels).
    import jax.numpy as jnp

    monkeypatch.setattr(bench, "_l2_scrub_kernels", None)
    scrub = [("input_reduce_fusion", 0.03), ("input_reduce_fusion_1", 0.001)]
    learned = []

    class FakeProfiler:
        @staticmethod
        def measure(fn, aggregate=True):
            assert fn is bench._read_l2_scrub and aggregate is False
            return lambda *args: (learned.append(args) or None, scrub)

    a = jnp.ones((4, 4))
    v = bench.JaxVariant("ours", lambda x, y: x @ y)
    v.cold_l2, v._profiler = True, FakeProfiler
    v._measure = lambda *args: (None, scrub + [("gemm_fusion_dot", 0.25), ("loop_reduce_fusion", 0.05)])
    assert v.kernel_ms(a, a) == pytest.approx(0.30)
    assert v.kernel_ms(a, a) == pytest.approx(0.30)
    assert len(learned) == 1
    v._measure = lambda *args: (None, [("gemm_fusion_dot", 0.25)])
    with pytest.raises(RuntimeError, match="--l2 cold"):
        v.kernel_ms(a, a)


def test_cold_l2_scrub_only_reads():
    # A scrub that wrote its buffer would leave L2 full of dirty lines, written back to
    # DRAM under the timed kernel: the program must write nothing but its one word.
    buf = bench.l2_scrub_buffer()
    assert buf.nbytes >= 2 * bench.L2_BYTES
    out = bench._read_l2_scrub(buf)
    assert out.shape == () and out.dtype == buf.dtype and int(out) == 0
    hlo = bench._read_l2_scrub.lower(buf).as_text()
    assert "reduce" in hlo and "xor" in hlo


def test_cold_l2_is_recorded_in_the_json(tmp_path, monkeypatch):
    # main() sets the protocol's globals from its flags: restored afterwards.
    monkeypatch.setattr(bench, "COLD_L2", False)
    out = tmp_path / "bench.json"
    bench.main(["--shapes", "32x48x40", "--no-torch", "--stages", "", "--samples", "1", "--rounds", "2",
                "--l2", "cold", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["meta"]["protocol"]["kernel_time_l2"] == "cold"
    assert all(r["kernel_ms"] > 0 for r in data["rows"])
