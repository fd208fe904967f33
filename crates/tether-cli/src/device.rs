//! The `--device` flag: `auto`, `cpu`, `cuda` or `cuda:N`.

use anyhow::{Result, bail};

/// A device named on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Every GPU when the machine has any (the cuda backend), else the cpu.
    Auto,
    /// Every GPU; an error when there is none.
    AllGpus,
    /// The cpu backend.
    Cpu,
    /// The cuda backend on GPU `N`.
    Cuda(usize),
}

impl DeviceChoice {
    /// Parses `auto`, `cpu`, `cuda` (every GPU) or `cuda:N`.
    pub fn parse(text: &str) -> Result<DeviceChoice> {
        match text {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::AllGpus),
            _ => match text.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceChoice::Cuda(n)),
                _ => bail!("unknown device {text:?}; use auto, cpu, cuda or cuda:N"),
            },
        }
    }

    /// The GPUs this choice runs on, given that the machine has `gpus` of them (empty: the
    /// cpu).
    pub fn gpus(self, gpus: usize) -> Result<Vec<usize>> {
        match self {
            DeviceChoice::Cpu => Ok(Vec::new()),
            DeviceChoice::Auto => Ok((0..gpus).collect()),
            DeviceChoice::AllGpus if gpus == 0 => {
                bail!(
                    "--device cuda: no CUDA GPU found (is the NVIDIA driver installed?); use --device cpu"
                )
            }
            DeviceChoice::AllGpus => Ok((0..gpus).collect()),
            DeviceChoice::Cuda(n) => Ok(vec![n]),
        }
    }
}

/// The GPUs `--device TEXT` names on this machine (empty: the cpu).
pub fn gpus_named(text: &str) -> Result<Vec<usize>> {
    DeviceChoice::parse(text)?.gpus(tether_compute::cuda::device_count())
}

/// The one device a single backend (a worker, `eval`, `bench`) runs on: the first GPU
/// `--device TEXT` names, or `None` for the cpu.
pub fn single_gpu(text: &str) -> Result<Option<usize>> {
    Ok(gpus_named(text)?.first().copied())
}

#[cfg(test)]
mod tests {
    use super::DeviceChoice;

    #[test]
    fn devices_parse_and_typos_are_refused() {
        assert_eq!(DeviceChoice::parse("cpu").unwrap(), DeviceChoice::Cpu);
        assert_eq!(DeviceChoice::parse("auto").unwrap(), DeviceChoice::Auto);
        assert_eq!(DeviceChoice::parse("cuda").unwrap(), DeviceChoice::AllGpus);
        assert_eq!(
            DeviceChoice::parse("cuda:3").unwrap(),
            DeviceChoice::Cuda(3)
        );
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            assert!(DeviceChoice::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn auto_takes_every_gpu_or_the_cpu() {
        assert_eq!(DeviceChoice::Auto.gpus(0).unwrap(), Vec::<usize>::new());
        assert_eq!(DeviceChoice::Auto.gpus(2).unwrap(), vec![0, 1]);
        assert_eq!(DeviceChoice::AllGpus.gpus(3).unwrap(), vec![0, 1, 2]);
        assert!(DeviceChoice::AllGpus.gpus(0).is_err());
        assert_eq!(DeviceChoice::Cuda(1).gpus(0).unwrap(), vec![1]);
        assert_eq!(DeviceChoice::Cpu.gpus(4).unwrap(), Vec::<usize>::new());
    }
}
