// Argument validation and dispatch to the compiled kernel instances.
#include "gemm/gemm.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>

namespace jax_hopper {

// Defined by the generated per-instance translation units (instance.cu.in).
template <KernelKind kKind, ElementType kType, Major kMajorA, Major kMajorB, int kStages>
Status launch_gemm_instance(const GemmArgs& args, cudaStream_t stream);
template <KernelKind kKind, ElementType kType, Major kMajorA, Major kMajorB, int kStages>
size_t workspace_bytes_instance(const GemmArgs& args, int sms);

namespace {

constexpr KernelKindInfo kKinds[] = {
#define JAX_HOPPER_KIND_INFO(K, NAME, STAGES, TARGET) {KernelKind::K, NAME, STAGES, TARGET},
    JAX_HOPPER_KERNEL_KINDS(JAX_HOPPER_KIND_INFO)
#undef JAX_HOPPER_KIND_INFO
};
static_assert(sizeof(kKinds) / sizeof(kKinds[0]) == kNumKernelKinds, "one entry per kind");

using LaunchFn = Status (*)(const GemmArgs&, cudaStream_t);
using WorkspaceFn = size_t (*)(const GemmArgs&, int);

// Every instance of the table; `launch` and `workspace` are null for those this build
// left out.
struct Instance {
  KernelInstance key;
  LaunchFn launch;
  WorkspaceFn workspace;
};

constexpr Instance kInstances[] = {
#define JAX_HOPPER_GEMM_INSTANCE(K, T, A, B, S)                     \
  {{KernelKind::K, ElementType::T, Major::A, Major::B, S},          \
   &launch_gemm_instance<KernelKind::K, ElementType::T, Major::A, Major::B, S>,  \
   &workspace_bytes_instance<KernelKind::K, ElementType::T, Major::A, Major::B, S>},
#define JAX_HOPPER_ABSENT_INSTANCE(K, T, A, B, S) \
  {{KernelKind::K, ElementType::T, Major::A, Major::B, S}, nullptr, nullptr},
#include "gemm/instances.inc"
#undef JAX_HOPPER_GEMM_INSTANCE
#undef JAX_HOPPER_ABSENT_INSTANCE
};

constexpr uintptr_t kTmaBaseAlignBytes = 16;
constexpr int kHopperMajor = 9;

// `rows` x `ld` is one stored matrix; `contiguous_extent` the logical length of a row.
Status check_operand(const char* name, const void* ptr, int64_t rows, int64_t ld, int64_t contiguous_extent,
                     int64_t batch, int64_t batch_stride) {
  const std::string n(name);
  if (ptr == nullptr) return Status::Invalid(n + " is a null pointer");
  if (reinterpret_cast<uintptr_t>(ptr) % kTmaBaseAlignBytes != 0)
    return Status::Invalid(n + " is not 16-byte aligned, which TMA requires");
  if (ld < contiguous_extent)
    return Status::Invalid(n + " row length " + std::to_string(ld) + " is shorter than its extent " +
                           std::to_string(contiguous_extent));
  if (ld % kTmaRowMultiple != 0)
    return Status::Invalid(n + " row length " + std::to_string(ld) +
                           " is not a multiple of 8 elements (16 bytes), which TMA requires; pad it");
  if (batch > 1 && (batch_stride < rows * ld || batch_stride % kTmaRowMultiple != 0))
    return Status::Invalid(n + " batch stride " + std::to_string(batch_stride) +
                           " overlaps its matrices or is not a multiple of 8 elements");
  return Status::Ok();
}

Status query_device(int device) {
  int major = 0, minor = 0;
  cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (err != cudaSuccess) return Status::Internal(std::string("querying the CUDA device: ") + cudaGetErrorString(err));
  if (major != kHopperMajor)
    return Status::Invalid("jax_hopper's kernel needs a Hopper GPU (sm_90a); device " + std::to_string(device) +
                           " is sm_" + std::to_string(major) + std::to_string(minor));
  return Status::Ok();
}

// The architecture check, answered once per device (a device does not change).
Status check_device() {
  constexpr int kMaxCachedDevices = 64;
  static std::atomic<bool> is_hopper[kMaxCachedDevices];
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return Status::Internal(std::string("cudaGetDevice: ") + cudaGetErrorString(err));
  const bool cacheable = device >= 0 && device < kMaxCachedDevices;
  if (cacheable && is_hopper[device].load(std::memory_order_relaxed)) return Status::Ok();
  Status st = query_device(device);
  if (st.ok() && cacheable) is_hopper[device].store(true, std::memory_order_relaxed);
  return st;
}

// The compiled instance for this choice and these operands' type and layout.
Status find_instance(const GemmArgs& args, const KernelChoice& choice, const Instance** found) {
  const bool a_k_major = args.major_a == Major::kK, b_k_major = args.major_b == Major::kK;
  const char* const name = kernel_kind_info(choice.kind).name;
  const std::string what = std::string(name) + " kernel for " + (args.dtype == ElementType::kF16 ? "f16" : "bf16") +
                           ", A " + (a_k_major ? "K" : "M") + "-major, B " + (b_k_major ? "K" : "N") +
                           "-major, with " + std::to_string(choice.stages) + " stages";
  for (const Instance& inst : kInstances) {
    const KernelInstance& key = inst.key;
    if (key.kind != choice.kind || key.dtype != args.dtype || key.major_a != args.major_a ||
        key.major_b != args.major_b || key.stages != choice.stages)
      continue;
    if (inst.launch == nullptr)
      return Status::Invalid("the " + what + " is an ablation or experimental instance, not compiled into this "
                             "build: configure with -DJAX_HOPPER_EXPERIMENTAL_KERNELS=ON");
    *found = &inst;
    return Status::Ok();
  }
  return Status::Invalid("no compiled " + what + " (jax_hopper/_kernels.py lists the instances)");
}

// The validated call on its compiled instance, on a Hopper GPU.
Status launch_instance(const GemmArgs& args, const KernelChoice& choice, cudaStream_t stream) {
  Status st = check_device();
  if (!st.ok()) return st;
  const Instance* inst = nullptr;
  st = find_instance(args, choice, &inst);
  if (!st.ok()) return st;
  return inst->launch(args, stream);
}

bool grouped_kind(KernelKind kind) { return kind == KernelKind::kGrouped || kind == KernelKind::kGroupedK; }

// A grouped product's contract (gemm.h: GemmArgs::group_sizes): the kind's layouts, the
// operands TMA reads, C's extent; K == 0 (no rows to sum, or nothing to contract) is C = 0.
Status grouped_gemm(const GemmArgs& args, const KernelChoice& choice, cudaStream_t stream) {
  const bool ragged_k = choice.kind == KernelKind::kGroupedK;
  if (args.fused() || args.batch != 1) return Status::Invalid("a grouped product takes no batch and no epilogue");
  if (args.group_sizes == nullptr || args.groups < 1)
    return Status::Invalid("a grouped product needs the group sizes (at least one group)");
  if (ragged_k ? (args.major_a != Major::kMN || args.major_b != Major::kMN) : args.major_a != Major::kK)
    return Status::Invalid(ragged_k ? "the ragged contraction reads A [k, m] and B [k, n]"
                                    : "ragged rows read A [m, k]");
  if (args.k_stored_a != 0 || args.k_stored_b != 0) return Status::Invalid("a grouped product stores all of K");
  const size_t c_bytes = args.c_f32 ? sizeof(float) : 2;
  const int64_t c_entries = ragged_k ? args.groups : 1;
  if (args.ldc != args.n || (c_entries > 1 && args.batch_stride_c != args.m * args.ldc))
    return Status::Invalid("a grouped product's C is contiguous");
  if (args.k == 0) {
    const cudaError_t err = cudaMemsetAsync(args.c, 0, c_entries * args.m * args.ldc * c_bytes, stream);
    return err == cudaSuccess ? Status::Ok() : Status::Internal(std::string("cudaMemsetAsync: ") + cudaGetErrorString(err));
  }
  const bool b_k_major = args.major_b == Major::kK;
  Status st = ragged_k ? check_operand("A", args.a, args.k, args.lda, args.m, 1, 0)
                       : check_operand("A", args.a, args.m, args.lda, args.k, 1, 0);
  if (!st.ok()) return st;
  if (args.group_period != 0 && (ragged_k || args.group_period < 2 || args.groups % args.group_period != 0))
    return Status::Invalid("a group period batches ragged rows: at least 2, dividing the groups");
  const int64_t b_entries = ragged_k ? 1 : (args.group_period > 0 ? args.group_period - 1 : args.groups);
  st = check_operand("B", args.b, b_k_major ? args.n : args.k, args.ldb, b_k_major ? args.k : args.n, b_entries,
                     args.batch_stride_b);
  if (!st.ok()) return st;
  return launch_instance(args, choice, stream);
}

}  // namespace

const KernelKindInfo* kernel_kind_info(int32_t id) {
  for (const KernelKindInfo& info : kKinds)
    if (static_cast<int32_t>(info.kind) == id) return &info;
  return nullptr;
}

std::vector<KernelInstance> compiled_instances() {
  std::vector<KernelInstance> compiled;
  for (const Instance& inst : kInstances)
    if (inst.launch != nullptr) compiled.push_back(inst.key);
  return compiled;
}

Status kernel_kind_for_target(int32_t id, const std::string& target, KernelKind* kind) {
  const KernelKindInfo* info = kernel_kind_info(id);
  if (info == nullptr) return Status::Invalid("unknown kernel " + std::to_string(id));
  if (target != info->target)
    return Status::Invalid("unknown kernel " + std::to_string(id) + " for " + target + " (" + info->name +
                           " is launched by " + info->target + ")");
  *kind = info->kind;
  return Status::Ok();
}

Status activation_of(int32_t id, Activation* activation) {
  if (id < 0 || id >= kNumActivations) return Status::Invalid("unknown activation " + std::to_string(id));
  *activation = static_cast<Activation>(id);
  return Status::Ok();
}

Status gemm(const GemmArgs& args, const KernelChoice& choice, cudaStream_t stream) {
  if (args.batch < 0 || args.m < 0 || args.n < 0 || args.k < 0) return Status::Invalid("negative problem size");
  constexpr int64_t kMaxDim = std::numeric_limits<int32_t>::max();  // TMA coordinates are int32
  if (args.batch > kMaxDim || args.m > kMaxDim || args.n > kMaxDim || args.k > kMaxDim)
    return Status::Invalid("batch, M, N and K must each be below 2^31");
  if (args.batch == 0 || args.m == 0 || args.n == 0) return Status::Ok();
  if (args.c == nullptr) return Status::Invalid("C is a null pointer");
  constexpr uintptr_t kWorkspaceAlign = 16;  // the partial sums' float4s
  if (args.workspace_bytes > 0 && reinterpret_cast<uintptr_t>(args.workspace) % kWorkspaceAlign != 0)
    return Status::Invalid("the workspace is not 16-byte aligned");
  if (grouped_kind(choice.kind) != (args.group_sizes != nullptr))
    return Status::Invalid("group sizes go with a grouped kind, and only there");
  if (grouped_kind(choice.kind)) return grouped_gemm(args, choice, stream);
  if (args.ldc < args.n) return Status::Invalid("C row length is shorter than N");
  if (args.batch > 1 && args.batch_stride_c < args.m * args.ldc) return Status::Invalid("C batch entries overlap");
  const size_t c_bytes = args.c_f32 ? sizeof(float) : 2;
  const bool grad_kind = choice.kind == KernelKind::kPersistentFusedGrad;
  const bool derivative_kind = choice.kind == KernelKind::kPersistentFusedDerivative;
  const bool fused_kind = choice.kind == KernelKind::kPersistentFused || grad_kind || derivative_kind;
  if (args.fused() && !fused_kind) return Status::Invalid("bias, residual or activation need the fused kernel");
  if (args.activation_grad != grad_kind)
    return Status::Invalid("an activation gradient needs the gradient kernel, and only it computes one");
  if ((args.derivative != nullptr) != derivative_kind)
    return Status::Invalid("a derivative output needs the derivative kernel, and only it writes one");
  if (derivative_kind) {
    // D is written by TMA only (no register-store path in this kind).
    constexpr uintptr_t kTmaStoreAlign = 16;
    if (args.residual != nullptr || args.activation == Activation::kNone || args.ldc % kTmaRowMultiple != 0 ||
        reinterpret_cast<uintptr_t>(args.c) % kTmaStoreAlign != 0 ||
        reinterpret_cast<uintptr_t>(args.derivative) % kTmaStoreAlign != 0)
      return Status::Invalid("a derivative output needs an activation, no residual, 16-byte aligned C and D, and a "
                             "row length that is a multiple of 8");
  }
  // Column sums: float2 stores, one row per 64 rows of C (column_sums.cuh).
  constexpr uintptr_t kColumnSumAlign = 2 * sizeof(float);
  if (args.column_sums != nullptr &&
      (!grad_kind || reinterpret_cast<uintptr_t>(args.column_sums) % kColumnSumAlign != 0))
    return Status::Invalid("column sums come only with an activation gradient, 8-byte aligned");
  if (choice.kind == KernelKind::kPersistentF16Acc && args.dtype != ElementType::kF16)
    return Status::Invalid("f16 accumulation takes f16 operands (wgmma has no bf16 accumulator)");
  if (fused_kind) {
    if (args.c_f32 || args.batch != 1)
      return Status::Invalid("the fused kernel computes one product with an output of the operands' type");
    if (args.k == 0) return Status::Invalid("the fused kernel needs K > 0 (its epilogue is not a zero fill)");
    if (args.residual != nullptr && args.ld_residual < args.n)
      return Status::Invalid("residual row length is shorter than N");
    // The backward form TMA-loads z (or the saved derivative) and TMA-stores C through the
    // same shared-memory sub-tiles (config.cuh: kStagedOperand).
    constexpr uintptr_t kTmaAlign = 16;
    if (args.activation_grad &&
        (args.residual == nullptr || args.bias != nullptr || args.n % kTmaRowMultiple != 0 ||
         args.ld_residual % kTmaRowMultiple != 0 ||
         args.ldc % kTmaRowMultiple != 0 || reinterpret_cast<uintptr_t>(args.residual) % kTmaAlign != 0 ||
         reinterpret_cast<uintptr_t>(args.c) % kTmaAlign != 0))
      return Status::Invalid("an activation gradient needs the pre-activation or the saved derivative (residual), "
                             "no bias, N a multiple of 8 (whole column pairs for its column sums), and 16-byte "
                             "aligned C and residual with row lengths a multiple of 8");
  }
  if (args.k == 0) {  // empty sums: C = 0
    for (int64_t b = 0; b < args.batch; ++b) {
      char* c = static_cast<char*>(args.c) + b * args.batch_stride_c * c_bytes;
      const cudaError_t err = cudaMemset2DAsync(c, args.ldc * c_bytes, 0, args.n * c_bytes, args.m, stream);
      if (err != cudaSuccess) return Status::Internal(std::string("cudaMemset2DAsync: ") + cudaGetErrorString(err));
    }
    return Status::Ok();
  }
  const bool a_k_major = args.major_a == Major::kK;
  const bool b_k_major = args.major_b == Major::kK;
  // A shorter stored K is for the K-outer operand only: a K-major one's rows must hold k.
  const auto k_stored_ok = [&](int64_t stored, bool k_major) {
    return stored == 0 || (!k_major && stored > 0 && stored <= args.k);
  };
  if (!k_stored_ok(args.k_stored_a, a_k_major) || !k_stored_ok(args.k_stored_b, b_k_major))
    return Status::Invalid("a stored K extent must be positive, at most K, and only on an operand whose K is its "
                           "outer dimension");
  Status st = check_operand("A", args.a, a_k_major ? args.m : args.k_of_a(), args.lda,
                            a_k_major ? args.k : args.m, args.batch, args.batch_stride_a);
  if (!st.ok()) return st;
  st = check_operand("B", args.b, b_k_major ? args.n : args.k_of_b(), args.ldb, b_k_major ? args.k : args.n,
                     args.batch, args.batch_stride_b);
  if (!st.ok()) return st;
  return launch_instance(args, choice, stream);
}

Status workspace_bytes(const GemmArgs& args, const KernelChoice& choice, int sms, size_t* bytes) {
  const Instance* inst = nullptr;
  const Status st = find_instance(args, choice, &inst);
  if (st.ok()) *bytes = inst->workspace(args, sms);
  return st;
}

}  // namespace jax_hopper
