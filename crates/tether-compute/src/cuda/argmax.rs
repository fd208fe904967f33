//! Arg-max and top candidates of logits rows on the device: a greedy decode step downloads
//! one id a row, a sampled one its k candidates, instead of the whole row (512 KiB for a
//! 128k vocabulary).

use cudarc::driver::LaunchConfig;

use super::check::{elems, f32s, need, shape_err};
use super::launch::{Arg, int};
use super::{CudaBackend, CudaBuffer};
use crate::backend::{Backend, DeviceBuffer, Result, check_targets, top_rows_scratch};

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
        let Some((xp, sp, cfg)) = self.row_launch(OP, x, n, out.len(), scratch, Some(4))? else {
            out.fill(0);
            return Ok(());
        };
        let rows = out.len();
        self.run(OP, cfg, &[Arg::Ptr(xp), Arg::U64(n as u64), Arg::Ptr(sp)])?;
        let mut bytes = vec![0u8; rows * 4];
        self.download(scratch, 0, &mut bytes)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
            *o = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }

    /// See [`Backend::top_rows`]; `top_rows` (select.cu) picks what
    /// [`crate::argmax::top_candidates`] does, in no order; the host sorts the k pairs.
    pub(super) fn top_on_device(
        &self,
        x: &CudaBuffer,
        n: usize,
        k: usize,
        scratch: &mut CudaBuffer,
        out: &mut [Vec<(u32, f32)>],
    ) -> Result<()> {
        const OP: &str = "top_rows";
        let rows = out.len();
        let per_row = top_rows_scratch(1, k);
        let launch = self.row_launch(OP, x, n, rows, scratch, per_row)?;
        let Some((xp, sp, cfg)) = launch.filter(|_| k > 0) else {
            out.iter_mut().for_each(Vec::clear);
            return Ok(());
        };
        let args = [
            Arg::Ptr(xp),
            Arg::U64(n as u64),
            int(OP, "k", k)?,
            int(OP, "rows", rows)?,
            Arg::Ptr(sp),
        ];
        self.run(OP, cfg, &args)?;
        // Every row's count, then its k (id, value bits) pairs: one download.
        let words = top_rows_scratch(rows, k).unwrap_or(0) / 4;
        let mut bytes = vec![0u8; 4 * words];
        self.download(scratch, 0, &mut bytes)?;
        let word = |i: usize| {
            let b = &bytes[4 * i..4 * i + 4];
            u32::from_le_bytes([b[0], b[1], b[2], b[3]])
        };
        for (r, o) in out.iter_mut().enumerate() {
            let count = (word(r) as usize).min(k);
            let first = rows + 2 * k * r;
            o.clear();
            o.extend((0..count).map(|c| {
                let at = first + 2 * c;
                (word(at), f32::from_bits(word(at + 1)))
            }));
            o.sort_unstable_by(crate::argmax::by_logit);
        }
        Ok(())
    }

    /// See [`Backend::score_rows`]; `score_rows` (select.cu) reduces each row on the
    /// device in f32 where [`crate::argmax::score_row`] sums in f64. The targets go to the
    /// start of `scratch`, the kernel writes two values a row after them.
    pub(super) fn score_on_device(
        &self,
        x: &CudaBuffer,
        n: usize,
        targets: &[u32],
        scratch: &mut CudaBuffer,
        out: &mut [(f32, f32)],
    ) -> Result<()> {
        const OP: &str = "score_rows";
        let rows = out.len();
        check_targets(targets, rows, n)?;
        let Some((xp, sp, cfg)) = self.row_launch(OP, x, n, rows, scratch, Some(12))? else {
            out.fill((f32::NEG_INFINITY, f32::NAN));
            return Ok(());
        };
        if !targets.is_empty() {
            let ids: Vec<u8> = targets.iter().flat_map(|t| t.to_le_bytes()).collect();
            self.upload(scratch, 0, &ids)?;
        }
        let results = 4 * rows;
        let args = [
            Arg::Ptr(xp),
            Arg::U64(n as u64),
            Arg::Ptr(sp),
            int(OP, "has_targets", usize::from(!targets.is_empty()))?,
            Arg::Ptr(sp + results as u64),
        ];
        self.run(OP, cfg, &args)?;
        let mut bytes = vec![0u8; 8 * rows];
        self.download(scratch, results, &mut bytes)?;
        for (o, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
            *o = (
                f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                f32::from_le_bytes([b[4], b[5], b[6], b[7]]),
            );
        }
        Ok(())
    }

    /// Checks a row reduction's operands (`rows` rows of `n` f32 in `x`, `scratch_per_row`
    /// bytes of scratch a row); the input's and scratch's addresses and a launch of one
    /// 1024-thread block a row, or `None` when there is nothing to run (no rows, or empty
    /// ones).
    fn row_launch(
        &self,
        op: &'static str,
        x: &CudaBuffer,
        n: usize,
        rows: usize,
        scratch: &CudaBuffer,
        scratch_per_row: Option<usize>,
    ) -> Result<Option<(u64, u64, LaunchConfig)>> {
        f32s(op, "input", x, elems(op, &[rows, n])?)?;
        let scratch_need = scratch_per_row.and_then(|b| b.checked_mul(rows));
        need(op, "scratch buffer", scratch.bytes(), scratch_need)?;
        let (xp, sp) = (
            self.addr(op, "input", x)?,
            self.addr(op, "scratch", scratch)?,
        );
        if rows == 0 || n == 0 {
            return Ok(None);
        }
        let grid =
            u32::try_from(rows).map_err(|_| shape_err(op, format!("{rows} rows are too many")))?;
        if u32::try_from(n).is_err() {
            return Err(shape_err(op, format!("rows of {n} values are too long")));
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        Ok(Some((xp, sp, cfg)))
    }
}
