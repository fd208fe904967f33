//! What the worker asks of the model side: plan a layer block from a GGUF header, build it
//! (all memory allocated at once), load its tensors, and run it. The worker's logic sees only
//! these traits, so it is testable without a model; [`crate::model_stage`] implements them
//! with `tether_model::Stage`.

use tether_protocol::{BlockSpec, ForwardInput, ForwardOutput, Result, Rows, TokenPos};

/// The sizes a forward pass is checked against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageShape {
    /// Hidden size.
    pub n_embd: usize,
    /// Vocabulary size (rows of the head).
    pub n_vocab: usize,
    /// The block served.
    pub spec: BlockSpec,
}

/// A tensor the block needs: its name in the GGUF file and its byte length there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorNeed {
    /// Tensor name.
    pub name: String,
    /// Bytes of its data.
    pub bytes: u64,
}

/// Builds layer blocks for one device.
pub trait StageFactory: Send + Sync + 'static {
    /// The device's name for logs and status.
    fn device_name(&self) -> String;

    /// Total and free device memory in bytes, as the driver reports them.
    fn memory_info(&self) -> Result<(u64, u64)>;

    /// Device bytes this process holds, as the driver counts them per process (NVML), when
    /// it can tell; other processes on the device do not move it.
    fn process_device_bytes(&self) -> Option<u64> {
        None
    }

    /// Whether the device's memory is this process's host memory (the cpu device): then
    /// what the worker holds is its resident set, not the system's used memory.
    fn holds_host_memory(&self) -> bool {
        false
    }

    /// Reads the hyper-parameters and tensor table from a GGUF header (the first bytes of a
    /// file of `file_bytes` bytes) and plans `spec`: which tensors are needed and how many
    /// bytes the built block will hold in all.
    fn plan(
        &self,
        gguf_header: &[u8],
        file_bytes: u64,
        spec: &BlockSpec,
    ) -> Result<Box<dyn PlannedStage>>;
}

/// A planned block: known size and tensors, nothing allocated yet.
pub trait PlannedStage: Send + 'static {
    /// The tensors the block needs, in the order the client should send them.
    fn tensors(&self) -> &[TensorNeed];

    /// Bytes the built block will hold: weights + KV cache + scratch.
    fn total_bytes(&self) -> u64;

    /// Allocates every buffer of the block (the only allocation it will ever make).
    fn build(self: Box<Self>) -> Result<Box<dyn ServingStage>>;
}

/// A built block: load its tensors once, then serve forward passes.
pub trait ServingStage: Send + 'static {
    /// The sizes a forward pass is checked against.
    fn shape(&self) -> StageShape;

    /// Copies `data` into tensor `name` at byte `offset`.
    fn load_tensor(&mut self, name: &str, offset: u64, data: &[u8]) -> Result<()>;

    /// Called once every tensor is loaded; the block is then ready to serve.
    fn finish_load(&mut self) -> Result<()>;

    /// Runs the block over `tokens`. Inputs were checked against [`Self::shape`] already.
    /// `rows` is what the caller wants for the logits rows; a block may return it directly
    /// (arg-max tokens found on its device) or return every logit for the caller to reduce.
    /// `targets` (with [`Rows::LogProbs`]: empty or one a logits row) are the token ids whose
    /// logits the rows' scores carry.
    fn forward(
        &mut self,
        tokens: &[TokenPos],
        input: ForwardInput,
        logits_rows: &[u32],
        rows: Rows,
        targets: &[u32],
    ) -> Result<ForwardOutput>;

    /// Forgets every KV cell of `seq`.
    fn kv_clear(&mut self, seq: u32) -> Result<()>;

    /// Keeps the first `length` positions of `seq`.
    fn kv_truncate(&mut self, seq: u32, length: u32) -> Result<()>;

    /// Makes `dst` hold the first `length` positions of `src` (which keeps them), copied
    /// inside the block's KV cache; what `dst` held is forgotten. The sequences differ and
    /// `src` holds at least `length` positions (checked by the block).
    fn kv_copy(&mut self, src: u32, dst: u32, length: u32) -> Result<()>;

    /// Bytes of device memory the block holds.
    fn bytes(&self) -> u64;

    /// Blocks of its paged KV pool: `(in the pool, held by no sequence)`; `(0, 0)` for a
    /// block without one.
    fn kv_pool(&self) -> (u64, u64) {
        (0, 0)
    }
}
