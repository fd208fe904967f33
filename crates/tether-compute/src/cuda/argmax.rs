//! Arg-max of logits rows on the device: a greedy decode step downloads one id a row
//! instead of the whole row (512 KiB for a 128k vocabulary).

use cudarc::driver::LaunchConfig;

use super::check::{elems, f32s, need, shape_err};
use super::launch::Arg;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{Backend, DeviceBuffer, Result};

impl CudaBackend {
    /// See [`Backend::argmax_rows`]; `argmax_rows` in elementwise.cu breaks ties and skips
    /// NaN as [`crate::argmax::greedy`] does.
    pub(super) fn argmax_on_device(
        &self,
        x: &CudaBuffer,
        n: usize,
        scratch: &mut CudaBuffer,
        out: &mut [u32],
    ) -> Result<()> {
        const OP: &str = "argmax_rows";
        let rows = out.len();
        f32s(OP, "input", x, elems(OP, &[rows, n])?)?;
        need(OP, "scratch buffer", scratch.bytes(), rows.checked_mul(4))?;
        let (xp, sp) = (
            self.addr(OP, "input", x)?,
            self.addr(OP, "scratch", scratch)?,
        );
        if rows == 0 {
            return Ok(());
        }
        if n == 0 {
            out.fill(0);
            return Ok(());
        }
        let grid =
            u32::try_from(rows).map_err(|_| shape_err(OP, format!("{rows} rows are too many")))?;
        if u32::try_from(n).is_err() {
            return Err(shape_err(OP, format!("rows of {n} values are too long")));
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        self.run(OP, cfg, &[Arg::Ptr(xp), Arg::U64(n as u64), Arg::Ptr(sp)])?;
        let mut bytes = vec![0u8; rows * 4];
        self.download(scratch, 0, &mut bytes)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}
