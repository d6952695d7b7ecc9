// How one operand tile (kExtent rows of M or N by kBlockK of K) sits in shared memory,
// and the TMA boxes and wgmma descriptors that agree on it. Both majors use the
// 128-byte swizzle; the difference is only which dimension runs along the 128-byte row.
//
//   K-major  (A [M,K], B [N,K]):  [kExtent][64 K]           one TMA box {64 K, kExtent}
//   MN-major (A [K,M], B [K,N]):  [kExtent/64][64 K][64 MN]  boxes {64 MN, 64 K}
//
// In both, 64 rows of M/N start 8 KB apart, so a consumer warpgroup's 64-row slice of A
// is the same offset either way.
#pragma once
#include <cstdint>

#include "gemm/gemm.h"
#include "hopper/wgmma.cuh"

namespace jax_hopper {

constexpr int kSwizzleBytes = 128;
constexpr int kSwizzleAtomRows = 8;                                     // 8 x 128 B = 1 KB
constexpr uint32_t kSwizzleAtomBytes = kSwizzleBytes * kSwizzleAtomRows;  // 1024
constexpr int kTmaMaxBoxDim = 256;

// kSplit CTAs of a cluster each load 1/kSplit of the tile's boxes and multicast them.
template <class Element, Major kMajor, int kExtent, int kBlockK, int kSplit = 1>
struct OperandLayout {
  static constexpr int kRowElems = kSwizzleBytes / sizeof(Element);  // 64
  static_assert(kBlockK == kRowElems, "one K tile is exactly one swizzle row of K");
  static_assert(kExtent % kRowElems == 0, "tile extent must be whole 64-element chunks");

  static constexpr int kElements = kExtent * kBlockK;
  static constexpr uint32_t kBytes = kElements * sizeof(Element);
  static constexpr uint32_t kBytesPer64Rows = 64 * kBlockK * sizeof(Element);  // 8 KB

  static constexpr bool kKMajor = kMajor == Major::kK;
  // wgmma transpose immediate: 0 reads the operand K-major, 1 reads it MN-major.
  static constexpr int kTranspose = kKMajor ? 0 : 1;

  // TMA: K-major takes the tile in kSplit boxes of rows; MN-major one box per 64 MN
  // elements (a 128-byte swizzled box row is at most 64 16-bit elements wide).
  static constexpr int kBoxInner = kRowElems;
  static constexpr int kBoxOuter = kKMajor ? kExtent / kSplit : kBlockK;
  static constexpr int kBoxes = kKMajor ? kSplit : kExtent / kRowElems;
  static constexpr int kBoxesPerCta = kBoxes / kSplit;
  static_assert(kBoxes % kSplit == 0, "boxes must divide evenly among the cluster");
  static constexpr uint32_t kBoxBytes = kBoxInner * kBoxOuter * sizeof(Element);
  static_assert(kBoxOuter <= kTmaMaxBoxDim, "TMA box dimension limit");

  // Descriptor byte offsets (PTX ISA, canonical 128B-swizzle layouts):
  //  K-major: SBO = distance between 8-row core-matrix groups along M/N; LBO unused.
  //  MN-major: LBO = distance between 64-element chunks along M/N; SBO = distance
  //  between groups of 8 K rows.
  static constexpr uint32_t kLeadingByteOffset = kKMajor ? 16 : kBytesPer64Rows;
  static constexpr uint32_t kStrideByteOffset = kSwizzleAtomBytes;
  // Advancing K by one wgmma (16 elements): 32 bytes along a swizzled K-major row (the
  // hardware applies the swizzle to the final address), or 16 rows of 128 B MN-major.
  template <int kMmaK>
  static constexpr uint32_t k_step_bytes() {
    return kKMajor ? kMmaK * sizeof(Element) : kMmaK * kSwizzleBytes;
  }

  // Where the wgmma that reads rows [64*slice, 64*slice + mma rows) and K elements
  // [16*k_step, 16*k_step + 16) of this tile starts, in bytes from the tile.
  template <int kMmaK>
  static constexpr uint32_t operand_offset(int slice, int k_step) {
    return slice * kBytesPer64Rows + k_step * k_step_bytes<kMmaK>();
  }

  // That wgmma's descriptor.
  template <int kMmaK>
  __device__ static uint64_t descriptor(const Element* tile, int slice, int k_step) {
    const char* base = reinterpret_cast<const char*>(tile) + operand_offset<kMmaK>(slice, k_step);
    return hopper::make_smem_desc(base, kLeadingByteOffset, kStrideByteOffset);
  }

  // The same descriptor as a compile-time offset from the one for slice 0, K step 0:
  // one 64-bit add moves a descriptor, where rebuilding it from the pointer costs a
  // shift, masks and the uniform-register moves for every wgmma (launch.cuh asserts the
  // kernel's shared memory fits a block's 227 KB, so the add never carries).
  template <int kMmaK>
  static constexpr uint64_t descriptor_offset(int slice, int k_step) {
    return hopper::smem_desc_advance(operand_offset<kMmaK>(slice, k_step));
  }

  // TMA box `box` of the tile whose first M/N row is mn0 and first K element is k0
  // (the batch coordinate is passed through unchanged).
  __device__ static void box_coords(int box, int mn0, int k0, int32_t& inner, int32_t& outer) {
    if constexpr (kKMajor) {
      inner = k0;
      outer = mn0 + box * kBoxOuter;
    } else {
      inner = mn0 + box * kRowElems;
      outer = k0;
    }
  }
  __device__ static Element* box_dst(Element* tile, int box) {
    return tile + box * (kBoxBytes / sizeof(Element));
  }
};

}  // namespace jax_hopper
