//! Receiving a block's tensor bytes: every chunk is checked against the plan (known tensor,
//! in order, within size) and every tensor's CRC-32 against the client's digest.

use crate::stage::{ServingStage, TensorNeed};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tether_protocol::{Result, WorkerError};

/// A tensor the client promises to send: name, length and CRC-32 (IEEE).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDigest {
    /// Tensor name.
    pub name: String,
    /// Bytes the client will send.
    pub bytes: u64,
    /// CRC-32 of those bytes.
    pub crc32: u32,
}

struct Incoming {
    expected_bytes: u64,
    expected_crc: u32,
    received: u64,
    hasher: crc32fast::Hasher,
}

/// The upload state of one Prepare: which bytes have arrived and whether they check out.
pub struct Staging {
    tensors: HashMap<String, Incoming>,
    times: StagingTimes,
    /// False when the bytes come from the very file the client's digests were taken
    /// from, so a checksum would compare the file with itself.
    checksums: bool,
}

/// Time spent checksumming and copying to the device, and the bytes staged, so far.
#[derive(Clone, Copy, Debug, Default)]
pub struct StagingTimes {
    /// Computing CRC-32s.
    pub checksum: Duration,
    /// Copying into the stage (to the device).
    pub upload: Duration,
    /// Tensor bytes accepted.
    pub bytes: u64,
}

impl Staging {
    /// Checks the client's digests against what the plan needs (same names, same sizes).
    pub fn new(needs: &[TensorNeed], digests: &[TensorDigest]) -> Result<Self> {
        let mut tensors = HashMap::with_capacity(needs.len());
        for d in digests {
            let need = needs.iter().find(|n| n.name == d.name).ok_or_else(|| {
                WorkerError::InvalidArgument(format!(
                    "tensor {:?} is not part of the planned layer block; send only the block's tensors",
                    d.name
                ))
            })?;
            if need.bytes != d.bytes {
                return Err(WorkerError::InvalidArgument(format!(
                    "tensor {:?}: client announces {} bytes, the GGUF header says {}",
                    d.name, d.bytes, need.bytes
                )));
            }
            let entry = Incoming {
                expected_bytes: d.bytes,
                expected_crc: d.crc32,
                received: 0,
                hasher: crc32fast::Hasher::new(),
            };
            if tensors.insert(d.name.clone(), entry).is_some() {
                return Err(WorkerError::InvalidArgument(format!(
                    "tensor {:?} is announced twice",
                    d.name
                )));
            }
        }
        if let Some(missing) = needs.iter().find(|n| !tensors.contains_key(&n.name)) {
            return Err(WorkerError::InvalidArgument(format!(
                "the layer block needs tensor {:?} ({} bytes) but the client does not announce it",
                missing.name, missing.bytes
            )));
        }
        Ok(Self {
            tensors,
            times: StagingTimes::default(),
            checksums: true,
        })
    }

    /// Staging that expects nothing (a placeholder after [`Staging::finish`]).
    pub(crate) fn empty() -> Self {
        Self {
            tensors: HashMap::new(),
            times: StagingTimes::default(),
            checksums: true,
        }
    }

    /// Stops computing and checking CRC-32s: only for bytes read from the very file the
    /// client mapped (its identity checked), never for bytes from the network.
    pub(crate) fn skip_checksums(&mut self) {
        self.checksums = false;
    }

    /// Checks one chunk and copies it into the stage.
    pub fn accept(
        &mut self,
        stage: &mut dyn ServingStage,
        name: &str,
        offset: u64,
        data: &[u8],
    ) -> Result<()> {
        let t = self.tensors.get_mut(name).ok_or_else(|| {
            WorkerError::InvalidArgument(format!("chunk for unannounced tensor {name:?}"))
        })?;
        if offset != t.received {
            return Err(WorkerError::InvalidArgument(format!(
                "tensor {name:?}: chunk at offset {offset}, expected {} (chunks must arrive in order without gaps)",
                t.received
            )));
        }
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= t.expected_bytes);
        let Some(end) = end else {
            return Err(WorkerError::InvalidArgument(format!(
                "tensor {name:?}: chunk of {} bytes at offset {offset} runs past its {} bytes",
                data.len(),
                t.expected_bytes
            )));
        };
        let started = Instant::now();
        stage.load_tensor(name, offset, data)?;
        let uploaded = Instant::now();
        if self.checksums {
            t.hasher.update(data);
            self.times.checksum += uploaded.elapsed();
        }
        t.received = end;
        self.times.upload += uploaded - started;
        self.times.bytes += data.len() as u64;
        Ok(())
    }

    /// Time spent so far checksumming and copying, and the bytes staged.
    pub fn times(&self) -> StagingTimes {
        self.times
    }

    /// Every announced tensor with its length, by name.
    pub(crate) fn expected(&self) -> Vec<(String, u64)> {
        let mut all: Vec<(String, u64)> = self
            .tensors
            .iter()
            .map(|(name, t)| (name.clone(), t.expected_bytes))
            .collect();
        all.sort();
        all
    }

    /// The first tensor (by name) whose bytes so far do not have the announced CRC-32: its
    /// name, the CRC-32 of what arrived, and the announced one.
    pub(crate) fn crc_mismatch(&self) -> Option<(String, u32, u32)> {
        if !self.checksums {
            return None;
        }
        let mut bad: Vec<(String, u32, u32)> = self
            .tensors
            .iter()
            .filter_map(|(name, t)| {
                let got = t.hasher.clone().finalize();
                (got != t.expected_crc).then(|| (name.clone(), got, t.expected_crc))
            })
            .collect();
        bad.sort();
        bad.into_iter().next()
    }

    /// Checks that every tensor arrived whole with the announced CRC-32.
    pub fn finish(self) -> Result<()> {
        let mut names: Vec<_> = self.tensors.into_iter().collect();
        names.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, t) in names {
            if t.received != t.expected_bytes {
                return Err(WorkerError::InvalidArgument(format!(
                    "tensor {name:?}: received {} of {} bytes before the upload ended",
                    t.received, t.expected_bytes
                )));
            }
            let crc = t.hasher.finalize();
            if self.checksums && crc != t.expected_crc {
                return Err(WorkerError::InvalidArgument(format!(
                    "tensor {name:?}: CRC-32 of the received bytes is {crc:#010x}, the client announced {:#010x}; the data was corrupted in transit or the client read a different file",
                    t.expected_crc
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeStage;

    fn need(name: &str, bytes: u64) -> TensorNeed {
        TensorNeed {
            name: name.into(),
            bytes,
        }
    }

    fn digest(name: &str, data: &[u8]) -> TensorDigest {
        TensorDigest {
            name: name.into(),
            bytes: data.len() as u64,
            crc32: crc32fast::hash(data),
        }
    }

    #[test]
    fn whole_tensors_with_right_crc_pass() {
        let data = b"abcdefgh";
        let mut staging = Staging::new(&[need("w", 8)], &[digest("w", data)]).unwrap();
        let mut stage = FakeStage::new(4, 1);
        staging.accept(&mut stage, "w", 0, &data[..5]).unwrap();
        staging.accept(&mut stage, "w", 5, &data[5..]).unwrap();
        staging.finish().unwrap();
        assert_eq!(stage.loaded_bytes, 8);
    }

    #[test]
    fn corrupted_bytes_fail_the_crc() {
        let mut staging = Staging::new(&[need("w", 4)], &[digest("w", b"abcd")]).unwrap();
        let mut stage = FakeStage::new(4, 1);
        staging.accept(&mut stage, "w", 0, b"abce").unwrap();
        let err = staging.finish().unwrap_err();
        assert!(err.to_string().contains("CRC-32"), "{err}");
    }

    #[test]
    fn gaps_overruns_and_unknown_tensors_are_refused() {
        let mut staging = Staging::new(&[need("w", 4)], &[digest("w", b"abcd")]).unwrap();
        let mut stage = FakeStage::new(4, 1);
        assert!(staging.accept(&mut stage, "w", 1, b"b").is_err());
        assert!(staging.accept(&mut stage, "w", 0, b"abcde").is_err());
        assert!(staging.accept(&mut stage, "x", 0, b"a").is_err());
        assert_eq!(stage.loaded_bytes, 0, "a refused chunk loads nothing");
    }

    #[test]
    fn digests_must_match_the_plan() {
        assert!(Staging::new(&[need("w", 4)], &[]).is_err());
        assert!(Staging::new(&[need("w", 4)], &[digest("w", b"abc")]).is_err());
        assert!(Staging::new(&[need("w", 1)], &[digest("w", b"a"), digest("v", b"b")]).is_err());
    }

    #[test]
    fn crc_mismatch_names_the_first_bad_tensor_without_consuming_the_staging() {
        let digests = [
            digest("a", b"aaaa"),
            digest("b", b"bbbb"),
            digest("c", b"cc"),
        ];
        let needs = [need("a", 4), need("b", 4), need("c", 2)];
        let mut staging = Staging::new(&needs, &digests).unwrap();
        assert_eq!(
            staging.expected(),
            vec![("a".into(), 4), ("b".into(), 4), ("c".into(), 2)]
        );
        let mut stage = FakeStage::new(4, 1);
        staging.accept(&mut stage, "a", 0, b"aaaa").unwrap();
        staging.accept(&mut stage, "b", 0, b"bbbx").unwrap();
        staging.accept(&mut stage, "c", 0, b"cX").unwrap();
        let (name, got, want) = staging.crc_mismatch().unwrap();
        assert_eq!(
            (name.as_str(), got, want),
            ("b", crc32fast::hash(b"bbbx"), crc32fast::hash(b"bbbb"))
        );
        assert!(staging.finish().is_err());
    }

    #[test]
    fn short_upload_is_refused() {
        let mut staging = Staging::new(&[need("w", 4)], &[digest("w", b"abcd")]).unwrap();
        let mut stage = FakeStage::new(4, 1);
        staging.accept(&mut stage, "w", 0, b"ab").unwrap();
        assert!(
            staging
                .finish()
                .unwrap_err()
                .to_string()
                .contains("received 2 of 4")
        );
    }
}
