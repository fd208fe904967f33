//! A stand-in for the model side in unit tests: blocks of plain host memory whose forward
//! pass adds 1 per layer to every hidden value; and a temporary directory.

use crate::stage::{PlannedStage, ServingStage, StageFactory, StageShape, TensorNeed};
use tether_protocol::{BlockSpec, ForwardInput, ForwardOutput, Rows, TokenPos};
use tether_protocol::{Result, WorkerError};

/// Bytes of each fake layer tensor.
pub const LAYER_TENSOR_BYTES: u64 = 64;
/// Hidden width of the fake model.
pub const N_EMBD: usize = 4;

/// A fake device with `free` bytes.
pub struct FakeFactory {
    pub free: u64,
}

impl StageFactory for FakeFactory {
    fn device_name(&self) -> String {
        "fake".into()
    }

    fn memory_info(&self) -> Result<(u64, u64)> {
        Ok((self.free, self.free))
    }

    fn plan(
        &self,
        header: &[u8],
        _file_bytes: u64,
        spec: &BlockSpec,
    ) -> Result<Box<dyn PlannedStage>> {
        if header != b"fake-gguf" {
            return Err(WorkerError::InvalidArgument(
                "not a fake GGUF header".into(),
            ));
        }
        let tensors = (spec.first_layer..spec.last_layer)
            .map(|i| TensorNeed {
                name: format!("blk.{i}.w"),
                bytes: LAYER_TENSOR_BYTES,
            })
            .collect::<Vec<_>>();
        let kv = (spec.ctx_per_seq * spec.n_seq * 8) as u64;
        let total = tensors.iter().map(|t| t.bytes).sum::<u64>() + kv;
        Ok(Box::new(FakePlan {
            tensors,
            total,
            spec: *spec,
        }))
    }
}

/// A fake planned block.
pub struct FakePlan {
    tensors: Vec<TensorNeed>,
    total: u64,
    spec: BlockSpec,
}

impl PlannedStage for FakePlan {
    fn tensors(&self) -> &[TensorNeed] {
        &self.tensors
    }

    fn total_bytes(&self) -> u64 {
        self.total
    }

    fn build(self: Box<Self>) -> Result<Box<dyn ServingStage>> {
        let mut stage = FakeStage::new(N_EMBD, self.spec.last_layer - self.spec.first_layer);
        stage.spec = self.spec;
        stage.kv_len = vec![0; self.spec.n_seq + self.spec.cached_seqs];
        stage.memory = vec![0; self.total as usize];
        Ok(Box::new(stage))
    }
}

/// A fake built block.
pub struct FakeStage {
    pub spec: BlockSpec,
    pub n_embd: usize,
    pub n_layers: usize,
    pub memory: Vec<u8>,
    pub loaded_bytes: u64,
    pub kv_len: Vec<u32>,
}

impl FakeStage {
    /// A block of `n_layers` layers of width `n_embd`.
    pub fn new(n_embd: usize, n_layers: usize) -> Self {
        Self {
            spec: BlockSpec {
                first_layer: 0,
                last_layer: n_layers,
                has_embed: false,
                has_head: false,
                ctx_per_seq: 16,
                n_seq: 2,
                cached_seqs: 0,
                ubatch: 8,
                cache_k: tether_gguf::GgmlType::F16,
                cache_v: tether_gguf::GgmlType::F16,
            },
            n_embd,
            n_layers,
            memory: Vec::new(),
            loaded_bytes: 0,
            kv_len: vec![0; 2],
        }
    }
}

impl ServingStage for FakeStage {
    fn shape(&self) -> StageShape {
        StageShape {
            n_embd: self.n_embd,
            n_vocab: 10,
            spec: self.spec,
        }
    }

    fn load_tensor(&mut self, _name: &str, _offset: u64, data: &[u8]) -> Result<()> {
        self.loaded_bytes += data.len() as u64;
        Ok(())
    }

    fn finish_load(&mut self) -> Result<()> {
        Ok(())
    }

    fn forward(
        &mut self,
        tokens: &[TokenPos],
        input: ForwardInput,
        _logits_rows: &[u32],
        _rows: Rows,
        _targets: &[u32],
    ) -> Result<ForwardOutput> {
        let ForwardInput::Hidden(mut h) = input else {
            return Err(WorkerError::InvalidArgument(
                "fake takes hidden states".into(),
            ));
        };
        for v in &mut h {
            *v += self.n_layers as f32;
        }
        for t in tokens {
            let len = &mut self.kv_len[t.seq as usize];
            *len = (*len).max(t.pos + 1);
        }
        Ok(ForwardOutput::Hidden(h))
    }

    fn kv_clear(&mut self, seq: u32) -> Result<()> {
        self.kv_len[seq as usize] = 0;
        Ok(())
    }

    fn kv_truncate(&mut self, seq: u32, length: u32) -> Result<()> {
        let len = &mut self.kv_len[seq as usize];
        *len = (*len).min(length);
        Ok(())
    }

    fn kv_copy(&mut self, src: u32, dst: u32, length: u32) -> Result<()> {
        if src == dst || length > self.kv_len[src as usize] {
            return Err(WorkerError::InvalidArgument(format!(
                "cannot copy {length} positions of sequence {src} to {dst}"
            )));
        }
        self.kv_len[dst as usize] = length;
        Ok(())
    }

    fn bytes(&self) -> u64 {
        self.memory.len() as u64
    }
}

/// A fresh directory under the system's temporary directory, removed on drop.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    /// Creates it.
    pub fn new() -> Self {
        let p = std::env::temp_dir().join(format!("tether-worker-test-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
