#include "ffi/gemm_ffi.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "gemm/gemm.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_hopper {
namespace {

std::string shape_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

ffi::Error to_ffi(const std::string& target, const Status& st) {
  switch (st.code) {
    case Status::kOk:
      return ffi::Error::Success();
    case Status::kInvalidArgument:
      return ffi::Error::InvalidArgument(target + ": " + st.message);
    default:
      return ffi::Error::Internal(target + ": " + st.message);
  }
}

// The custom call's contract (the Python lowering guarantees it; everything is
// re-checked here so a malformed call is rejected instead of read out of bounds):
//  all of rank 2, or all of one rank >= 3 with the same leading batch dims (folded into
//  one batch dim here: each keeps its own sharding in the program); per batch entry
//  c is [M, N]; a is [M, K] (or [K, ldA >= M] with transpose_a); b is [K, ldB >= N] (or
//  [N, K] with transpose_b). Or a [..., M, K] (not transposed) and c [..., M, N] against
//  a rank-2 b: a's and c's rows are contiguous, so their leading dims fold into M here
//  (a reshape in the lowering would have to name explicit mesh shardings it cannot keep).
//  A stored row may be longer than its logical extent: the Python side pads rows to the
//  16-byte multiple TMA needs. Padded M/N columns are never read; a K-major operand's
//  padded K columns are (zeros, from the Python side), and then the other operand, if
//  its K is the outer dimension, may hold 1-7 fewer K rows than that padded K: TMA
//  reads zeros past them. c is a's type, or f32.
ffi::Error decode(ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer>& c, int32_t transpose_a,
                  int32_t transpose_b, GemmArgs& args) {
  const auto shapes = [&] {
    return " (a" + shape_str(a.dimensions()) + ", b" + shape_str(b.dimensions()) + ", c" +
           shape_str(c->dimensions()) + ", transpose_a=" + std::to_string(transpose_a) +
           ", transpose_b=" + std::to_string(transpose_b) + ")";
  };
  std::vector<int64_t> db(b.dimensions().begin(), b.dimensions().end());
  std::vector<int64_t> da(a.dimensions().begin(), a.dimensions().end());
  std::vector<int64_t> dc(c->dimensions().begin(), c->dimensions().end());
  if (db.size() == 2 && da.size() > 2) {
    if (transpose_a || dc.size() != da.size() || !std::equal(da.begin(), da.end() - 1, dc.begin()))
      return ffi::Error::InvalidArgument("jax_hopper_gemm: a [..., M, K] against a 2-D b needs c [..., M, N] and "
                                         "transpose_a=0" + shapes());
    const int64_t rows = std::accumulate(da.begin(), da.end() - 1, int64_t{1}, std::multiplies<int64_t>());
    da = {rows, da.back()};
    dc = {rows, dc.back()};
  }
  if (db.size() > 3 && da.size() == db.size() && dc.size() == db.size()) {
    const auto lead = db.size() - 2;
    if (!std::equal(da.begin(), da.begin() + lead, db.begin()) ||
        !std::equal(dc.begin(), dc.begin() + lead, db.begin()))
      return ffi::Error::InvalidArgument("jax_hopper_gemm: batch dims differ" + shapes());
    const int64_t batch = std::accumulate(db.begin(), db.begin() + lead, int64_t{1}, std::multiplies<int64_t>());
    for (auto* d : {&da, &db, &dc}) d->erase(d->begin(), d->begin() + lead - 1);
    da[0] = db[0] = dc[0] = batch;
  }
  const size_t rank = dc.size();
  if ((rank != 2 && rank != 3) || da.size() != rank || db.size() != rank)
    return ffi::Error::InvalidArgument("jax_hopper_gemm: operands must all be rank 2, all of one rank >= 3, or a "
                                       "[..., M, K] against a 2-D b" + shapes());
  const auto type = a.element_type();
  if (b.element_type() != type || (type != ffi::DataType::F16 && type != ffi::DataType::BF16))
    return ffi::Error::InvalidArgument("jax_hopper_gemm: a and b must both be f16 or both bf16");
  if (c->element_type() != type && c->element_type() != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("jax_hopper_gemm: c must have a's type or be f32");

  const size_t r = rank - 2;  // index of the row dimension of each matrix
  args.dtype = type == ffi::DataType::F16 ? ElementType::kF16 : ElementType::kBF16;
  args.c_f32 = c->element_type() == ffi::DataType::F32;
  args.major_a = transpose_a ? Major::kMN : Major::kK;
  args.major_b = transpose_b ? Major::kK : Major::kMN;
  args.batch = rank == 3 ? dc[0] : 1;
  if (rank == 3 && (da[0] != args.batch || db[0] != args.batch))
    return ffi::Error::InvalidArgument("jax_hopper_gemm: batch sizes differ" + shapes());
  args.m = dc[r];
  args.n = dc[r + 1];
  args.ldc = args.n;
  // Stored shapes: the contiguous (last) dim is the row length; the other names M/N/K.
  args.lda = da[r + 1];
  args.ldb = db[r + 1];
  const int64_t k_a = transpose_a ? da[r] : da[r + 1];
  const int64_t k_b = transpose_b ? db[r + 1] : db[r];
  const bool a_rows_ok = transpose_a || da[r] == args.m;
  const bool b_rows_ok = !transpose_b || db[r] == args.n;
  // K may differ only by the K-major operand's row padding, the other one (K outer,
  // transpose_a / !transpose_b) stored unpadded: its missing rows read as zeros.
  const bool a_k_outer = transpose_a, b_k_outer = !transpose_b;
  const bool k_ok = k_a == k_b || (k_b < k_a && b_k_outer && !a_k_outer && k_a - k_b < kTmaRowMultiple) ||
                    (k_a < k_b && a_k_outer && !b_k_outer && k_b - k_a < kTmaRowMultiple);
  if (!k_ok || !a_rows_ok || !b_rows_ok)
    return ffi::Error::InvalidArgument("jax_hopper_gemm: inconsistent shapes" + shapes());
  args.k = std::max(k_a, k_b);
  if (k_a < args.k) args.k_stored_a = k_a;
  if (k_b < args.k) args.k_stored_b = k_b;
  args.batch_stride_a = da[r] * da[r + 1];
  args.batch_stride_b = db[r] * db[r + 1];
  args.batch_stride_c = args.m * args.n;
  args.a = a.untyped_data();
  args.b = b.untyped_data();
  args.c = c->untyped_data();
  return ffi::Error::Success();
}

// Every handler ends here: the kind's launch with the call's workspace, its last result
// (the dynamic order's ticket counter, split K's and stream-K's partial sums), which XLA
// plans like any buffer: it stays the call's until the kernel has run, whichever stream
// XLA runs the call on, and nothing is allocated at run time (so XLA may capture the
// call into a command buffer).
std::atomic<uint64_t> handler_runs{0};

ffi::Error run(const std::string& target, GemmArgs& args, KernelKind kind, int stages,
               ffi::Result<ffi::AnyBuffer>& workspace, cudaStream_t stream) {
  handler_runs.fetch_add(1, std::memory_order_relaxed);
  args.workspace = workspace->untyped_data();
  args.workspace_bytes = workspace->size_bytes();
  KernelChoice choice;
  choice.kind = kind;
  choice.stages = stages;
  return to_ffi(target, gemm(args, choice, stream));
}

ffi::Error GemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                    ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> workspace, int32_t transpose_a,
                    int32_t transpose_b, int32_t kernel, int32_t stages) {
  const std::string target = "jax_hopper_gemm";
  GemmArgs args;
  if (ffi::Error err = decode(a, b, c, transpose_a, transpose_b, args); err.failure()) return err;
  KernelKind kind;
  if (const Status st = kernel_kind_for_target(kernel, target, &kind); !st.ok()) return to_ffi(target, st);
  return run(target, args, kind, stages, workspace, stream);
}

// The fused handlers' shared part: decode, a rank-2 b, c of the operands' type, and the
// activation.
ffi::Error decode_fused(const std::string& target, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Result<ffi::AnyBuffer>& c,
                        int32_t transpose_a, int32_t transpose_b, int32_t activation, GemmArgs& args) {
  if (ffi::Error err = decode(a, b, c, transpose_a, transpose_b, args); err.failure()) return err;
  if (b.dimensions().size() != 2 || c->element_type() != a.element_type())
    return ffi::Error::InvalidArgument(target + ": b must be rank 2 and c of the operands' type");
  return to_ffi(target, activation_of(activation, &args.activation));
}

// An optional bias [N] of the operands' type (empty: none).
ffi::Error decode_bias(const std::string& target, ffi::AnyBuffer bias, ffi::DataType type, GemmArgs& args) {
  if (bias.element_count() == 0) return ffi::Error::Success();
  const auto db = bias.dimensions();
  if (bias.element_type() != type || db.size() != 1 || db[0] != args.n)
    return ffi::Error::InvalidArgument(target + ": bias must be [N] of the operands' type, got " + shape_str(db));
  args.bias = bias.untyped_data();
  return ffi::Error::Success();
}

// The residual (or the backward form's z): c's shape and type; empty: none.
ffi::Error decode_residual(const std::string& target, ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer>& c,
                           GemmArgs& args) {
  if (residual.element_count() == 0) return ffi::Error::Success();
  const auto dr = residual.dimensions(), dc = c->dimensions();
  if (residual.element_type() != c->element_type() || !std::equal(dr.begin(), dr.end(), dc.begin(), dc.end()))
    return ffi::Error::InvalidArgument(target + ": residual must be c's shape " + shape_str(dc) +
                                       " and the operands' type, got " + shape_str(dr));
  args.residual = residual.untyped_data();
  args.ld_residual = args.n;
  return ffi::Error::Success();
}

// The fused product C = act(A * B + bias) + residual: the contract of GemmImpl for a 2-D
// b (a [M, K] or [..., M, K]) with an output of the operands' type, plus bias [N] and
// residual (c's shape) of that type, each passed as an empty array when absent.
ffi::Error GemmFusedImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                         ffi::AnyBuffer bias, ffi::AnyBuffer residual, ffi::Result<ffi::AnyBuffer> c,
                         ffi::Result<ffi::AnyBuffer> workspace, int32_t transpose_a, int32_t transpose_b, int32_t activation) {
  const std::string target = "jax_hopper_gemm_fused";
  GemmArgs args;
  if (ffi::Error err = decode_fused(target, a, b, c, transpose_a, transpose_b, activation, args); err.failure())
    return err;
  if (ffi::Error err = decode_bias(target, bias, a.element_type(), args); err.failure()) return err;
  if (ffi::Error err = decode_residual(target, residual, c, args); err.failure()) return err;
  return run(target, args, KernelKind::kPersistentFused, kernel_kind_info(KernelKind::kPersistentFused).stages, workspace,
             stream);
}

// The backward form C = (A * B) * act'(z) (gemm.h: GemmArgs::activation_grad; with
// activation 0, z is the saved act'(z) and C a product times it): the fused contract
// with z (c's shape and type) in the residual's place and no bias, plus a second result
// column_sums, f32 [ceil(M / 64), N]: C's column sums per 64 rows (a bias gradient,
// summed over its rows by the caller), computed before C is rounded; empty for none.
ffi::Error GemmFusedGradImpl(cudaStream_t stream, ffi::AnyBuffer a,
                             ffi::AnyBuffer b, ffi::AnyBuffer z, ffi::Result<ffi::AnyBuffer> c,
                             ffi::Result<ffi::AnyBuffer> column_sums, ffi::Result<ffi::AnyBuffer> workspace,
                             int32_t transpose_a, int32_t transpose_b, int32_t activation) {
  const std::string target = "jax_hopper_gemm_fused_grad";
  GemmArgs args;
  if (ffi::Error err = decode_fused(target, a, b, c, transpose_a, transpose_b, activation, args); err.failure())
    return err;
  if (ffi::Error err = decode_residual(target, z, c, args); err.failure()) return err;
  args.activation_grad = true;
  if (column_sums->element_count() != 0) {
    const auto ds = column_sums->dimensions();
    const int64_t row_blocks = (args.m + kColumnSumRows - 1) / kColumnSumRows;
    if (column_sums->element_type() != ffi::DataType::F32 || ds.size() != 2 || ds[0] != row_blocks ||
        ds[1] != args.n)
      return ffi::Error::InvalidArgument(target + ": column_sums must be f32 [" + std::to_string(row_blocks) + ", " +
                                         std::to_string(args.n) + "] (a row per 64 rows of c), got " +
                                         shape_str(ds));
    args.column_sums = static_cast<float*>(column_sums->untyped_data());
  }
  return run(target, args, KernelKind::kPersistentFusedGrad,
             kernel_kind_info(KernelKind::kPersistentFusedGrad).stages, workspace, stream);
}

// C = act(A * B + bias) and D = act'(A * B + bias): the contract of GemmFusedImpl with
// no residual and no gradient form, plus the second result d of c's shape and type.
ffi::Error GemmFusedDerivativeImpl(cudaStream_t stream, ffi::AnyBuffer a,
                                   ffi::AnyBuffer b, ffi::AnyBuffer bias, ffi::Result<ffi::AnyBuffer> c,
                                   ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace,
                                   int32_t transpose_a, int32_t transpose_b, int32_t activation) {
  GemmArgs args;
  const std::string target = "jax_hopper_gemm_fused_derivative";
  if (ffi::Error err = decode_fused(target, a, b, c, transpose_a, transpose_b, activation, args); err.failure())
    return err;
  if (ffi::Error err = decode_bias(target, bias, a.element_type(), args); err.failure()) return err;
  const auto dc = c->dimensions(), dd = d->dimensions();
  if (d->element_type() != c->element_type() || !std::equal(dd.begin(), dd.end(), dc.begin(), dc.end()))
    return ffi::Error::InvalidArgument(target + ": d must have c's shape " + shape_str(dc) +
                                       " and type, got " + shape_str(dd));
  args.derivative = d->untyped_data();
  return run(target, args, KernelKind::kPersistentFusedDerivative,
             kernel_kind_info(KernelKind::kPersistentFusedDerivative).stages, workspace, stream);
}

// A grouped product (ragged_dot), by the `kernel` attribute's kind:
//  grouped (ragged rows): a [M, K], b [G, K, N] (or [G, N, K] with transpose_b),
//    c [M, N]: rows of group g (group_sizes, in order) times b[g]; rows past the sizes'
//    sum are zeros. With `period` P > 0 (vmap over a, b shared): group g times
//    b[g % P], b having P - 1 entries, and groups g % P == P - 1 are gaps (zeros).
//  grouped_k (ragged contraction): a [R, Ka], b [R, N], c [G, Ka, N]: per group g, its
//    rows of a, transposed, times its rows of b.
// group_sizes is int32 [G], read on the device; c is a's type or f32.
ffi::Error RaggedDotImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer group_sizes,
                         ffi::Result<ffi::AnyBuffer> c, ffi::Result<ffi::AnyBuffer> workspace, int32_t transpose_b,
                         int32_t kernel, int32_t period) {
  const std::string target = "jax_hopper_ragged_dot";
  KernelKind kind;
  if (const Status st = kernel_kind_for_target(kernel, target, &kind); !st.ok()) return to_ffi(target, st);
  const auto da = a.dimensions(), db = b.dimensions(), dc = c->dimensions(), dg = group_sizes.dimensions();
  const std::string shapes = " (a" + shape_str(da) + ", b" + shape_str(db) + ", group_sizes" + shape_str(dg) +
                             ", c" + shape_str(dc) + ", transpose_b=" + std::to_string(transpose_b) + ")";
  const auto type = a.element_type();
  if (b.element_type() != type || (type != ffi::DataType::F16 && type != ffi::DataType::BF16) ||
      (c->element_type() != type && c->element_type() != ffi::DataType::F32) ||
      group_sizes.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument(target + ": a and b must both be f16 or both bf16, c of their type or f32, "
                                       "group_sizes int32");
  if (dg.size() != 1 || da.size() != 2) return ffi::Error::InvalidArgument(target + ": bad ranks" + shapes);
  const int64_t groups = dg[0];
  GemmArgs args;
  args.dtype = type == ffi::DataType::F16 ? ElementType::kF16 : ElementType::kBF16;
  args.c_f32 = c->element_type() == ffi::DataType::F32;
  if (kind == KernelKind::kGrouped) {
    const int64_t entries = period > 0 ? period - 1 : groups;
    const bool ok = db.size() == 3 && dc.size() == 2 && db[0] == entries && dc[0] == da[0] &&
                    (transpose_b ? db[2] == da[1] && dc[1] == db[1] : db[1] == da[1] && dc[1] == db[2]);
    if (!ok) return ffi::Error::InvalidArgument(target + ": ragged rows take a [M, K], b [G, K, N] (or [G, N, K] "
                                                "with transpose_b; G = period - 1 with a period), c [M, N]" + shapes);
    args.group_period = period;
    args.m = da[0], args.k = da[1], args.n = dc[1];
    args.major_a = Major::kK;
    args.major_b = transpose_b ? Major::kK : Major::kMN;
    args.batch_stride_b = db[1] * db[2];
  } else {
    const bool ok = !transpose_b && period == 0 && db.size() == 2 && dc.size() == 3 && db[0] == da[0] && dc[0] == groups &&
                    dc[1] == da[1] && dc[2] == db[1];
    if (!ok) return ffi::Error::InvalidArgument(target + ": the ragged contraction takes a [R, M], b [R, N], "
                                                "c [G, M, N]" + shapes);
    args.m = da[1], args.k = da[0], args.n = db[1];
    args.major_a = Major::kMN;
    args.major_b = Major::kMN;
    args.batch_stride_c = args.m * args.n;
  }
  args.lda = da[1];
  args.ldb = db.back();
  args.ldc = args.n;
  args.a = a.untyped_data();
  args.b = b.untyped_data();
  args.c = c->untyped_data();
  args.group_sizes = group_sizes.untyped_data();
  args.groups = groups;
  return run(target, args, kind, kernel_kind_info(kind).stages, workspace, stream);
}

}  // namespace

uint64_t ffi_handler_runs() { return handler_runs.load(std::memory_order_relaxed); }

}  // namespace jax_hopper

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxHopperGemm, jax_hopper::GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Ret<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("transpose_a")
                                  .Attr<int32_t>("transpose_b")
                                  .Attr<int32_t>("kernel")
                                  .Attr<int32_t>("stages"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxHopperGemmFused, jax_hopper::GemmFusedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // bias ([N] or empty)
                                  .Arg<ffi::AnyBuffer>()  // residual (c's shape, or empty)
                                  .Ret<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("transpose_a")
                                  .Attr<int32_t>("transpose_b")
                                  .Attr<int32_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxHopperGemmFusedGrad, jax_hopper::GemmFusedGradImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // z (c's shape), or the saved act'(z)
                                  .Ret<ffi::AnyBuffer>()  // c = (a b) * act'(z)
                                  .Ret<ffi::AnyBuffer>()  // column_sums (f32 [ceil(M / 64), N], or empty)
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("transpose_a")
                                  .Attr<int32_t>("transpose_b")
                                  .Attr<int32_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxHopperGemmFusedDerivative, jax_hopper::GemmFusedDerivativeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // bias ([N] or empty)
                                  .Ret<ffi::AnyBuffer>()  // c = act(a b + bias)
                                  .Ret<ffi::AnyBuffer>()  // d = act'(a b + bias)
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("transpose_a")
                                  .Attr<int32_t>("transpose_b")
                                  .Attr<int32_t>("activation"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxHopperRaggedDot, jax_hopper::RaggedDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()  // a
                                  .Arg<ffi::AnyBuffer>()  // b
                                  .Arg<ffi::AnyBuffer>()  // group_sizes (int32 [G])
                                  .Ret<ffi::AnyBuffer>()  // c
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("transpose_b")
                                  .Attr<int32_t>("kernel")
                                  .Attr<int32_t>("period"),
                              {ffi::Traits::kCmdBufferCompatible});
