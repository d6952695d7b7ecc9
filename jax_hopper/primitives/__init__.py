"""The JAX primitives, one module each with all of its rules: abstract evaluation,
lowerings (the FFI custom call on CUDA, XLA elsewhere), partitioning, JVP/transpose and
batching.

  gemm              C = op(A) op(B) (also how a lax.dot_general maps onto it)
  dense             act(x w + b) + r, and a layer's path through the dispatcher
  dense_derivative  act(x w + b) and act'(x w + b)
  dense_grad        (g w^T) * act'(z) and its column sums (the MLP's backward form)
  mlp_tangent       the MLP block's tangent map, transposed into the fused backward pass
"""
