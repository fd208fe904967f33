//! `--cache-type-k` and `--cache-type-v` (llama.cpp's `-ctk`/`-ctv`): how the KV cache is
//! stored, shared by `run`, `bench`, `eval`, `plan` and `serve`.

use clap::{Args, ValueEnum};
use tether_gguf::GgmlType;

/// Element type of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CacheType {
    /// 16-bit floats: 2 bytes per value.
    F16,
    /// 8-bit blocks (llama.cpp's q8_0): 34 bytes per 32 values.
    #[value(name = "q8_0")]
    Q8_0,
    /// 4-bit blocks (llama.cpp's q4_0): 18 bytes per 32 values.
    #[value(name = "q4_0")]
    Q4_0,
}

impl CacheType {
    /// The ggml type the cache is stored as.
    pub fn ggml(self) -> GgmlType {
        match self {
            CacheType::F16 => GgmlType::F16,
            CacheType::Q8_0 => GgmlType::Q8_0,
            CacheType::Q4_0 => GgmlType::Q4_0,
        }
    }
}

/// The KV cache flags. Quantized caches need a head size that is a multiple of 32, and
/// for now K and V must have the same type; loading says so otherwise.
#[derive(Args, Debug, Clone, Copy)]
pub struct CacheArgs {
    /// Element type of the K cache: f16, q8_0 or q4_0.
    #[arg(long, value_enum, default_value = "f16")]
    pub cache_type_k: CacheType,
    /// Element type of the V cache: f16, q8_0 or q4_0 (the same as the K cache, for now).
    #[arg(long, value_enum, default_value = "f16")]
    pub cache_type_v: CacheType,
}

impl CacheArgs {
    /// The K cache's ggml type.
    pub fn k(&self) -> GgmlType {
        self.cache_type_k.ggml()
    }

    /// The V cache's ggml type.
    pub fn v(&self) -> GgmlType {
        self.cache_type_v.ggml()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        cache: CacheArgs,
    }

    #[test]
    fn flags_name_the_llama_cpp_types_and_default_to_f16() {
        let cli = Cli::try_parse_from(["t"]).unwrap();
        assert_eq!(
            (cli.cache.k(), cli.cache.v()),
            (GgmlType::F16, GgmlType::F16)
        );
        let cli =
            Cli::try_parse_from(["t", "--cache-type-k", "q8_0", "--cache-type-v", "q4_0"]).unwrap();
        assert_eq!(
            (cli.cache.k(), cli.cache.v()),
            (GgmlType::Q8_0, GgmlType::Q4_0)
        );
        for ty in [CacheType::F16, CacheType::Q8_0, CacheType::Q4_0] {
            let name = ty.to_possible_value().unwrap();
            assert_eq!(name.get_name(), ty.ggml().name());
        }
        assert!(Cli::try_parse_from(["t", "--cache-type-k", "q4_k"]).is_err());
    }
}
