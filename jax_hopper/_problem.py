"""A product as the kernel would run it: the facts the dispatcher decides on.

Shapes here are those of the primitives' operands, after a dot_general has been planned
onto the kernel's [B...,] M x K times K x N form (_plan.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# TMA needs 16-byte global row strides: a stored row of 16-bit elements must hold a
# multiple of 8 of them. Shorter rows are padded on the way into the custom call.
TMA_ROW_MULTIPLE = 8
TMA_ROW_ALIGN_BYTES = 16  # TMA and cuBLASLt's fast kernels want 16-byte row strides
# The kernel's largest batch, M, N or K: its tile coordinates are int32.
KERNEL_MAX_DIM = 2**31 - 1

H200_PEAK_FLOPS = 989e12  # dense f16/bf16 tensor-core peak
H200_PEAK_BYTES_PER_S = 4.8e12  # HBM3e
H200_SMS = 132

# What a problem computes. "product": C = op(A) op(B). "dense": act(x w + b) + r in the
# fused epilogue. "dense_derivative": act(x w + b) and act'(x w + b). "activation_grad":
# the MLP's backward form (g w^T) * act'(z), with its column sums when bias_grad.
# "ragged_rows": a grouped product (ragged_dot), batch = the groups, M its lhs rows, B
# [G, K, N] (transpose_b: [G, N, K]). "ragged_contract": its rhs gradient, per group
# lhs^T rhs over the group's rows: batch = the groups, K the rows, A stored [K, M].
OPS = ("product", "dense", "dense_derivative", "activation_grad", "ragged_rows", "ragged_contract")


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Problem:
    batch: int  # 0: no batch dims; else the product of them
    m: int
    n: int
    k: int
    itemsize: int  # of A and B
    out_itemsize: int
    transpose_a: bool  # A stored [K, M]
    transpose_b: bool  # B stored [N, K]
    op: str = "product"
    activation: str | None = None
    bias_grad: bool = False  # activation_grad: the layer's bias gradient is wanted too
    f16_accumulation: bool = False  # product: the caller allows f16 sums

    @property
    def operand_rows(self) -> tuple[int, int]:
        """Stored row lengths (elements) of A and B."""
        return (self.m if self.transpose_a else self.k, self.k if self.transpose_b else self.n)

    @property
    def fits_kernel(self) -> bool:
        """Every dimension, and each stored row as TMA pads it, within int32."""
        padded_rows = (round_up(row, TMA_ROW_MULTIPLE) for row in self.operand_rows)
        return all(d <= KERNEL_MAX_DIM for d in (self.batch, self.m, self.n, self.k, *padded_rows))

    @property
    def rows_aligned(self) -> bool:
        a_row, b_row = self.operand_rows
        return (a_row * self.itemsize % TMA_ROW_ALIGN_BYTES == 0 and b_row * self.itemsize % TMA_ROW_ALIGN_BYTES == 0
                and self.n * self.out_itemsize % TMA_ROW_ALIGN_BYTES == 0)

    @property
    def flops(self) -> float:
        return 2.0 * max(self.batch, 1) * self.m * self.n * self.k

    @property
    def compute_us(self) -> float:
        """Its time at the H200's dense tensor-core peak."""
        return 1e6 * self.flops / H200_PEAK_FLOPS

    @property
    def padding_copy_us(self) -> float:
        """HBM time of the copies that pad stored rows for TMA (each unaligned operand read
        once and written once at the padded length); zero where every row is aligned."""
        b = max(self.batch, 1)
        a_row, b_row = self.operand_rows
        a_rows, b_rows = (self.k if self.transpose_a else self.m), (self.n if self.transpose_b else self.k)
        moved = sum(2 * b * outer * round_up(row, TMA_ROW_MULTIPLE) * self.itemsize
                    for row, outer in ((a_row, a_rows), (b_row, b_rows)) if row % TMA_ROW_MULTIPLE)
        return 1e6 * moved / H200_PEAK_BYTES_PER_S

    @property
    def roofline_us(self) -> float:
        """The H200's lower bound on its time: compute, or HBM traffic of the operands and
        output, whichever binds."""
        b = max(self.batch, 1)
        moved = b * ((self.m * self.k + self.k * self.n) * self.itemsize + self.m * self.n * self.out_itemsize)
        return max(self.compute_us, 1e6 * moved / H200_PEAK_BYTES_PER_S)


def numeric(*dims) -> bool:
    """Every dim a number. A symbolic one (jax.export's shape polymorphism) is not: the
    rules and the kernel's launch need sizes, so such products are jax's."""
    return all(isinstance(d, (int, np.integer)) for d in dims)


def mnk(a_shape, b_shape, transpose_a: bool, transpose_b: bool):
    """(M, N, K of A, K of B) of the primitive's stored operands."""
    m, k = (a_shape[-1], a_shape[-2]) if transpose_a else a_shape[-2:]
    k_b, n = (b_shape[-1], b_shape[-2]) if transpose_b else b_shape[-2:]
    return m, n, k, k_b


def problem_of(a_shape, b_shape, dtype, out_dtype, transpose_a: bool, transpose_b: bool, **op) -> Problem:
    """The Problem of the primitive's operands: [B...,] stored A and B (the batch dims
    counted as one), or A [..., M, K] against a 2-D B (A's leading dims folded into M).
    `op`: Problem's op fields (op, activation, bias_grad, f16_accumulation)."""
    batch = math.prod(a_shape[:-2]) if len(a_shape) == len(b_shape) >= 3 else 0
    a2, b2 = a_shape[-2:], b_shape[-2:]
    folded = math.prod(a_shape[:-2]) if len(b_shape) == 2 else 1
    m = (a2[1] if transpose_a else a2[0]) * folded
    k = a2[0] if transpose_a else a2[1]
    n = b2[0] if transpose_b else b2[1]
    return Problem(batch, int(m), int(n), int(k), np.dtype(dtype).itemsize, np.dtype(out_dtype).itemsize,
                   bool(transpose_a), bool(transpose_b), **op)


def layer_problem(x_shape, w_shape, dtype, *, transpose_w: bool = False, **op) -> Problem:
    """The Problem of a layer's product x [..., K] times w [K, N] (w stored [N, K] with
    transpose_w), x's leading dims folded into M as the FFI handler folds them."""
    m, k = math.prod(x_shape[:-1]), x_shape[-1]
    return problem_of((m, k), w_shape, dtype, dtype, False, transpose_w, **op)


def fits_kernel(a_shape, b_shape, transpose_a: bool = False, transpose_b: bool = False) -> bool:
    """Whether the kernel can take a primitive's operands of these shapes. Shapes with a
    symbolic dim are not judged here (the callers keep those on XLA)."""
    if not numeric(*a_shape, *b_shape):
        return True
    return problem_of(a_shape, b_shape, np.float16, np.float16, transpose_a, transpose_b).fits_kernel
