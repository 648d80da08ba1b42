"""The feed-forward kinds, with the standard library only, so that a config (``tlm_model.ModelConfig``) or
a command line names them without importing torch."""

#: The feed-forward kinds :func:`tlm_ffn.default_d_ff` knows: the gated SwiGLU and the two-matrix SiLU FFN.
FFN_KINDS = ("swiglu", "silu")
