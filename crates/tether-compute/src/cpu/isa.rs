//! The instruction-set level the cpu backend's kernels run at: the best the CPU has,
//! detected once per backend, or a lower one named by `TETHER_CPU_ISA` (to compare paths
//! on one machine, and to test each path where the CPU has several).

use std::fmt;

use crate::cpu::simd::{Avx2, Avx512Vnni, AvxVnni};
use crate::error::ComputeError;

/// The environment variable that forces a kernel level.
pub const CPU_ISA_ENV: &str = "TETHER_CPU_ISA";

/// A level of the cpu backend's SIMD kernels. Each level above `Scalar` runs its own
/// kernels where it has them and the next level's elsewhere; every level gives the same
/// integer sums, so results do not depend on the level.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CpuIsa {
    /// Portable Rust, no SIMD intrinsics.
    Scalar,
    /// AVX2 with FMA and F16C.
    Avx2,
    /// AVX2 plus the 256-bit VEX-encoded VNNI dot product (`avxvnni`: Intel since Alder
    /// Lake, AMD since Zen 5).
    AvxVnni,
    /// AVX-512 F, BW and VL with VNNI (Intel since Ice Lake server, AMD since Zen 4).
    Avx512Vnni,
}

impl CpuIsa {
    /// Every level, lowest first.
    pub const ALL: [CpuIsa; 4] = [Self::Scalar, Self::Avx2, Self::AvxVnni, Self::Avx512Vnni];

    /// The name `TETHER_CPU_ISA` takes and logs print.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avx-vnni",
            Self::Avx512Vnni => "avx512-vnni",
        }
    }

    /// Whether the running CPU can run this level.
    pub fn is_available(self) -> bool {
        match self {
            Self::Scalar => true,
            Self::Avx2 => Avx2::detect().is_some(),
            Self::AvxVnni => AvxVnni::detect().is_some(),
            Self::Avx512Vnni => Avx512Vnni::detect().is_some(),
        }
    }

    /// The best level of the running CPU (AVX-512 VNNI before AVX-VNNI: it is the one with
    /// kernels for more types).
    pub fn detect() -> Self {
        [Self::Avx512Vnni, Self::AvxVnni, Self::Avx2]
            .into_iter()
            .find(|l| l.is_available())
            .unwrap_or(Self::Scalar)
    }

    /// The level named by `TETHER_CPU_ISA`, or [`Self::detect`] when it is unset.
    pub fn from_env() -> Result<Self, ComputeError> {
        match std::env::var(CPU_ISA_ENV) {
            Ok(v) => Self::choose(Some(&v)),
            Err(std::env::VarError::NotPresent) => Self::choose(None),
            Err(e) => Err(ComputeError::Unavailable(format!(
                "{CPU_ISA_ENV} is not valid text ({e}); unset it or name a level ({})",
                Self::names()
            ))),
        }
    }

    /// The level `value` names (`None`, empty or `auto`: the best available), refusing a
    /// name it does not know and a level this CPU lacks.
    pub fn choose(value: Option<&str>) -> Result<Self, ComputeError> {
        let value = value.map(str::trim).unwrap_or_default();
        if value.is_empty() || value.eq_ignore_ascii_case("auto") {
            return Ok(Self::detect());
        }
        let isa = Self::ALL
            .into_iter()
            .find(|l| l.name().eq_ignore_ascii_case(value))
            .ok_or_else(|| {
                ComputeError::Unavailable(format!(
                    "{CPU_ISA_ENV}={value:?} names no kernel level; use auto or one of {}",
                    Self::names()
                ))
            })?;
        isa.require()?;
        Ok(isa)
    }

    /// An error unless the running CPU can run this level.
    pub(crate) fn require(self) -> Result<(), ComputeError> {
        if self.is_available() {
            return Ok(());
        }
        Err(ComputeError::Unavailable(format!(
            "the cpu kernel level {self} needs instructions this CPU lacks (its best level is \
             {}); ask for that or a lower one",
            Self::detect()
        )))
    }

    fn names() -> String {
        Self::ALL.map(Self::name).join(", ")
    }

    /// The AVX2 token when this level includes AVX2 (every level but `Scalar`).
    pub(crate) fn avx2(self) -> Option<Avx2> {
        match self {
            Self::Scalar => None,
            _ => Avx2::detect(),
        }
    }

    /// The AVX-512 VNNI token when this is that level.
    pub(crate) fn avx512_vnni(self) -> Option<Avx512Vnni> {
        match self {
            Self::Avx512Vnni => Avx512Vnni::detect(),
            _ => None,
        }
    }

    /// The AVX-VNNI token when this is that level.
    pub(crate) fn avx_vnni(self) -> Option<AvxVnni> {
        match self {
            Self::AvxVnni => AvxVnni::detect(),
            _ => None,
        }
    }
}

impl fmt::Display for CpuIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back_and_unknown_names_are_refused() {
        for isa in CpuIsa::ALL.into_iter().filter(|l| l.is_available()) {
            assert_eq!(CpuIsa::choose(Some(isa.name())).unwrap(), isa);
            let upper = isa.name().to_uppercase();
            assert_eq!(CpuIsa::choose(Some(&upper)).unwrap(), isa);
        }
        assert_eq!(CpuIsa::choose(None).unwrap(), CpuIsa::detect());
        assert_eq!(CpuIsa::choose(Some(" auto ")).unwrap(), CpuIsa::detect());
        let err = CpuIsa::choose(Some("avx1024")).unwrap_err().to_string();
        assert!(err.contains("avx1024") && err.contains("avx2"), "{err}");
    }

    #[test]
    fn a_level_the_cpu_lacks_is_refused_by_name() {
        for isa in CpuIsa::ALL.into_iter().filter(|l| !l.is_available()) {
            let err = CpuIsa::choose(Some(isa.name())).unwrap_err().to_string();
            assert!(err.contains(isa.name()), "{err}");
        }
        assert!(CpuIsa::Scalar.is_available());
        assert!(CpuIsa::detect().is_available());
    }

    /// Each level hands out exactly its own tokens, so forcing a level cannot reach the
    /// kernels of a higher one.
    #[test]
    fn tokens_follow_the_level() {
        assert!(CpuIsa::Scalar.avx2().is_none());
        for isa in CpuIsa::ALL.into_iter().filter(|l| l.is_available()) {
            assert_eq!(isa.avx2().is_some(), isa != CpuIsa::Scalar, "{isa}");
            assert_eq!(isa.avx512_vnni().is_some(), isa == CpuIsa::Avx512Vnni);
            assert_eq!(isa.avx_vnni().is_some(), isa == CpuIsa::AvxVnni);
        }
        eprintln!(
            "this CPU runs: {}",
            CpuIsa::ALL
                .into_iter()
                .filter(|l| l.is_available())
                .map(CpuIsa::name)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
}
