//! The `--device` flag: `cpu` or `cuda:N`.

use anyhow::{Result, bail};

/// A device named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The cpu backend.
    Cpu,
    /// The cuda backend on GPU `N`.
    Cuda(usize),
}

impl DeviceChoice {
    /// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`.
    pub fn parse(text: &str) -> Result<DeviceChoice> {
        match text {
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda(0)),
            _ => match text.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => bail!("unknown device {text:?}; use cpu, cuda or cuda:N"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceChoice;

    #[test]
    fn devices_parse_and_typos_are_refused() {
        assert_eq!(DeviceChoice::parse("cpu").unwrap(), DeviceChoice::Cpu);
        assert_eq!(DeviceChoice::parse("cuda").unwrap(), DeviceChoice::Cuda(0));
        assert_eq!(
            DeviceChoice::parse("cuda:3").unwrap(),
            DeviceChoice::Cuda(3)
        );
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(DeviceChoice::parse(bad).is_err(), "{bad}");
        }
    }
}
