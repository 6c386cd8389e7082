"""Process plumbing, not maths: BLAS threads, the float mode of training threads, parallel splitting."""
