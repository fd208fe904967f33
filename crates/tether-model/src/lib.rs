//! Architectures, hyper-parameters, tokenizers, sampling, forward pass and the layer plan.
