//! [`Backend`] for [`CudaBackend`]: size checks, then one kernel launch per op (a few for
//! large batches) on the backend's stream.

use cudarc::driver::{LaunchConfig, result};
use tether_gguf::GgmlType;

use super::check::{
    cache_type_supported, elems, f32s, need, row_bytes, shape_err, unsupported,
    weight_type_supported,
};
use super::launch::{Arg, grid_for, int};
use super::staging;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{
    AttnShape, AttnSpan, Backend, DeviceBuffer, GateAct, KvCache, KvCacheMut, MemoryInfo, Qkv,
    Result, Rope, Scores, Weight,
};
use crate::cuda::device::driver_err;
use crate::moe::{MoeFfn, MoeRouting, MoeScratch};
use crate::operands::common_cols;
use crate::shared::SharedArea;

/// Threads per block of the element-wise kernels.
const THREADS: u32 = 256;
impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Replays = super::CudaReplays;
    type Uploads = super::CudaUploads;
    type Borrowed = super::shared::Borrowed;

    fn replay<R>(&self, replays: &mut Self::Replays, key: u64, f: impl FnOnce() -> R) -> Result<R> {
        self.replay_step(replays, key, f)
    }

    fn name(&self) -> String {
        self.device.name.clone()
    }

    fn memory_info(&self) -> Result<MemoryInfo> {
        let (free, total) = self.device.mem_info()?;
        Ok(MemoryInfo { total, free })
    }

    fn process_memory(&self) -> Option<u64> {
        self.process_used()
    }

    fn alloc_many(&self, sizes: &[usize]) -> Result<Vec<CudaBuffer>> {
        self.device.alloc_many(sizes)
    }

    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        self.device.alloc(bytes)
    }

    fn finish_weight(&self, w: &mut CudaBuffer, ty: GgmlType, row_len: usize) -> Result<()> {
        self.pack_weight(w, ty, row_len)
    }

    fn upload(&self, dst: &mut CudaBuffer, offset: usize, src: &[u8]) -> Result<()> {
        let at = self.upload_target(dst, offset, src.len())?;
        if src.is_empty() {
            return Ok(());
        }
        if self.lock_staging().record_upload(at, src)? {
            return Ok(());
        }
        self.device.flush_recorded()?;
        self.device.bind()?;
        // SAFETY: the range is inside `dst` (checked). For pageable host memory the driver
        // has copied `src` into its own staging before returning, so `src` may go after.
        unsafe { result::memcpy_htod_async(at, src, self.device.stream.cu_stream()) }
            .map_err(|e| driver_err(&format!("uploading {} bytes", src.len()), e))
    }

    fn begin_uploads(&self) -> Result<super::CudaUploads> {
        super::CudaUploads::new(&self.device)
    }

    fn upload_weight(
        &self,
        uploads: &mut super::CudaUploads,
        dst: &mut CudaBuffer,
        offset: usize,
        src: &[u8],
    ) -> Result<()> {
        if self.device.recording_here() {
            return self.upload(dst, offset, src);
        }
        let at = self.upload_target(dst, offset, src.len())?;
        uploads.copy(at, src)
    }

    fn finish_uploads(&self, mut uploads: super::CudaUploads) -> Result<()> {
        uploads.wait()
    }

    fn download(&self, src: &CudaBuffer, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.device.flush_recorded()?;
        need(
            "download",
            "source buffer",
            src.bytes(),
            offset.checked_add(dst.len()),
        )?;
        let at = self.addr("download", "source buffer", src)? + offset as u64;
        if dst.is_empty() {
            return Ok(());
        }
        self.device.bind()?;
        if dst.len() <= staging::BOUNCE_MAX {
            let mut bounce = self.bounce.lock().unwrap_or_else(|p| p.into_inner());
            return bounce.download(&self.device, at, dst);
        }
        // SAFETY: the range is inside `src` (checked); the stream is synchronized below
        // before `dst` is handed back.
        unsafe { result::memcpy_dtoh_async(dst, at, self.device.stream.cu_stream()) }
            .map_err(|e| driver_err(&format!("downloading {} bytes", dst.len()), e))?;
        self.device.synchronize()
    }

    fn synchronize(&self) -> Result<()> {
        self.device.synchronize()
    }

    fn get_rows(
        &self,
        table: &CudaBuffer,
        ty: GgmlType,
        row_len: usize,
        ids: &[u32],
        out: &mut CudaBuffer,
    ) -> Result<()> {
        const OP: &str = "get_rows";
        if !weight_type_supported(ty) {
            return Err(unsupported(OP, ty));
        }
        let rb = row_bytes(OP, ty, row_len)?;
        let n_rows = table.bytes().checked_div(rb).unwrap_or(0);
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= n_rows) {
            return Err(shape_err(
                OP,
                format!("row id {bad} is outside the table of {n_rows} rows of {row_len} {ty}"),
            ));
        }
        f32s(OP, "output", out, elems(OP, &[ids.len(), row_len])?)?;
        let (t, o) = (
            self.addr(OP, "table", table)?,
            self.addr(OP, "output", out)?,
        );
        if ids.is_empty() || row_len == 0 {
            return Ok(());
        }
        let row_len = int(OP, "row length", row_len)?;
        let _ = int(OP, "token count", ids.len())?;
        let mut staging = self.lock_staging();
        let ids_at = staging.stage_u32(ids)?;
        let cfg = LaunchConfig {
            grid_dim: (ids.len() as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(t),
            Arg::I32(super::packed::kernel_type_id(table, ty)),
            Arg::U64(rb as u64),
            row_len,
            Arg::Ptr(ids_at),
            Arg::Ptr(o),
        ];
        self.run("get_rows", cfg, &args)
    }

    fn matmul(
        &self,
        w: Weight<'_, CudaBuffer>,
        x: &CudaBuffer,
        n_tokens: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let (wp, xp, op) = self.matmul_operands(w, x, n_tokens, out)?;
        if w.rows == 0 || n_tokens == 0 {
            return Ok(());
        }
        if w.cols == 0 {
            return self.zero(op, w.rows * n_tokens * 4);
        }
        self.product(w, (wp, xp, op), n_tokens, false)
    }

    fn matmul3(
        &self,
        ws: [Weight<'_, CudaBuffer>; 3],
        x: &CudaBuffer,
        n_tokens: usize,
        outs: [&mut CudaBuffer; 3],
    ) -> Result<()> {
        let cols = common_cols("matmul", &ws)?;
        let weights = ws.map(|w| (w.buf, w.ty));
        let family = self
            .fused_family(weights, cols, n_tokens)
            .or_else(|| self.mixed_qkv_family(weights, cols, n_tokens));
        let Some(family) = family else {
            let [q, k, v] = &outs;
            if self.grouped_qkv(ws, x, n_tokens, [q, k, v])? {
                return Ok(());
            }
            for (w, out) in ws.into_iter().zip(outs) {
                self.matmul(w, x, n_tokens, out)?;
            }
            return Ok(());
        };
        let mut addrs = [(0u64, 0u64); 3];
        let mut xp = 0;
        for (i, (w, out)) in ws.into_iter().zip(outs).enumerate() {
            let (wp, xa, o) = self.matmul_operands(w, x, n_tokens, out)?;
            addrs[i] = (wp, o);
            xp = xa;
        }
        let rows = ws.map(|w| w.rows);
        if n_tokens == 0 || rows.iter().sum::<usize>() == 0 {
            return Ok(());
        }
        self.matvec3(family, addrs, rows, cols, xp, n_tokens)
    }

    fn matmul_swiglu(
        &self,
        gate_up: [Weight<'_, CudaBuffer>; 2],
        x: &CudaBuffer,
        n_tokens: usize,
        out: &mut CudaBuffer,
        tmp: [&mut CudaBuffer; 2],
    ) -> Result<()> {
        self.gated_product(GateAct::Silu, gate_up, x, n_tokens, out, tmp)
    }

    fn matmul_gated(
        &self,
        act: GateAct,
        gate_up: [Weight<'_, CudaBuffer>; 2],
        x: &CudaBuffer,
        n_tokens: usize,
        out: &mut CudaBuffer,
        tmp: [&mut CudaBuffer; 2],
    ) -> Result<()> {
        self.gated_product(act, gate_up, x, n_tokens, out, tmp)
    }

    fn geglu(
        &self,
        gate: &CudaBuffer,
        up: &CudaBuffer,
        n: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.gated_elementwise(GateAct::GeluTanh, gate, up, n, out)
    }

    fn scale(&self, x: &mut CudaBuffer, n: usize, factor: f32) -> Result<()> {
        self.scalar_op("scale", x, n, factor)
    }

    fn softcap(&self, x: &mut CudaBuffer, n: usize, cap: f32) -> Result<()> {
        self.scalar_op("softcap", x, n, cap)
    }

    fn matmul_add(
        &self,
        w: Weight<'_, CudaBuffer>,
        x: &CudaBuffer,
        n_tokens: usize,
        acc: &mut CudaBuffer,
        tmp: &mut CudaBuffer,
    ) -> Result<()> {
        if w.cols == 0 {
            self.matmul(w, x, n_tokens, tmp)?;
            return self.add(acc, tmp, n_tokens * w.rows);
        }
        let (wp, xp, ap) = self.matmul_operands(w, x, n_tokens, acc)?;
        if w.rows == 0 || n_tokens == 0 {
            return Ok(());
        }
        // The matvec kernels and the GEMM's last store add into `acc`: no product in
        // `tmp`, no add pass.
        self.product(w, (wp, xp, ap), n_tokens, true)
    }

    fn add_bias(
        &self,
        x: &mut CudaBuffer,
        bias: &CudaBuffer,
        n_tokens: usize,
        dim: usize,
    ) -> Result<()> {
        const OP: &str = "add_bias";
        let n = elems(OP, &[n_tokens, dim])?;
        f32s(OP, "input", x, n)?;
        f32s(OP, "bias", bias, dim)?;
        let (xp, bp) = (self.addr(OP, "input", x)?, self.addr(OP, "bias", bias)?);
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::Ptr(xp),
            Arg::Ptr(bp),
            Arg::U64(n as u64),
            Arg::U64(dim as u64),
        ];
        self.run("add_bias", grid_for(n, THREADS), &args)
    }

    fn rms_norm(
        &self,
        x: &CudaBuffer,
        weight: &CudaBuffer,
        n_tokens: usize,
        dim: usize,
        eps: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.rms_norm_rows(x, weight, n_tokens, dim, eps, out)
    }

    fn rope(
        &self,
        x: &mut CudaBuffer,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        positions: &[u32],
        rope: Rope<'_, CudaBuffer>,
    ) -> Result<()> {
        let heads = (n_tokens, n_heads, head_dim);
        self.rope_on_device(x, heads, positions, rope)
    }

    fn rope_and_store(
        &self,
        qkv: Qkv<'_, CudaBuffer>,
        shape: AttnShape,
        positions: &[u32],
        rope: Rope<'_, CudaBuffer>,
        cells: &[u32],
        cache: KvCacheMut<'_, CudaBuffer>,
    ) -> Result<()> {
        self.rope_and_store_on_device(qkv, shape, positions, rope, cells, cache)
    }

    fn kv_store(
        &self,
        src: &CudaBuffer,
        kv_dim: usize,
        cells: &[u32],
        cache: &mut CudaBuffer,
        cache_ty: GgmlType,
    ) -> Result<()> {
        const OP: &str = "kv_store";
        if !cache_type_supported(cache_ty) {
            return Err(unsupported(OP, cache_ty));
        }
        let rb = row_bytes(OP, cache_ty, kv_dim)?;
        f32s(OP, "source", src, elems(OP, &[cells.len(), kv_dim])?)?;
        let n_cells = cache.bytes().checked_div(rb).unwrap_or(0);
        if let Some(&bad) = cells.iter().find(|&&c| c as usize >= n_cells) {
            return Err(shape_err(
                OP,
                format!("cell {bad} is outside the cache of {n_cells} cells"),
            ));
        }
        let (sp, cp) = (
            self.addr(OP, "source", src)?,
            self.addr(OP, "cache", cache)?,
        );
        if cells.is_empty() || kv_dim == 0 {
            return Ok(());
        }
        let mut staging = self.lock_staging();
        let cells_at = staging.stage_u32(cells)?;
        let mut args = vec![
            Arg::Ptr(sp),
            int(OP, "kv_dim", kv_dim)?,
            Arg::Ptr(cells_at),
            int(OP, "token count", cells.len())?,
            Arg::Ptr(cp),
        ];
        if cache_ty == GgmlType::F16 {
            self.run(
                "kv_store_f16",
                grid_for(cells.len() * kv_dim, THREADS),
                &args,
            )
        } else {
            args.push(Arg::I32(cache_ty.id() as i32));
            let blocks = cells.len() * (kv_dim / 32);
            self.run("kv_store_quant", grid_for(blocks, THREADS), &args)
        }
    }

    fn attention(
        &self,
        q: &CudaBuffer,
        cache: KvCache<'_, CudaBuffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        scale: f32,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let scores = Scores::scaled(scale);
        self.run_attention(q, cache, spans, shape, scores, out)
    }

    fn attention_capped(
        &self,
        q: &CudaBuffer,
        cache: KvCache<'_, CudaBuffer>,
        spans: &[AttnSpan],
        shape: AttnShape,
        scores: Scores,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.run_attention(q, cache, spans, shape, scores, out)
    }

    fn swiglu(
        &self,
        gate: &CudaBuffer,
        up: &CudaBuffer,
        n: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        self.gated_elementwise(GateAct::Silu, gate, up, n, out)
    }

    fn moe_route(
        &self,
        logits: &CudaBuffer,
        n_tokens: usize,
        routing: MoeRouting,
        ids: &mut CudaBuffer,
        weights: &mut CudaBuffer,
    ) -> Result<()> {
        self.moe_route_on_device(logits, n_tokens, routing, ids, weights)
    }

    fn moe_ffn(
        &self,
        ffn: MoeFfn<'_, CudaBuffer>,
        acc: &mut CudaBuffer,
        scratch: MoeScratch<'_, CudaBuffer>,
    ) -> Result<()> {
        self.moe_ffn_on_device(ffn, acc, scratch)
    }

    fn add(&self, x: &mut CudaBuffer, y: &CudaBuffer, n: usize) -> Result<()> {
        const OP: &str = "add";
        f32s(OP, "x", x, n)?;
        f32s(OP, "y", y, n)?;
        let (xp, yp) = (self.addr(OP, "x", x)?, self.addr(OP, "y", y)?);
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::Ptr(xp), Arg::Ptr(yp), Arg::U64(n as u64)];
        self.run("add", grid_for(n, THREADS), &args)
    }

    fn copy(&self, src: &CudaBuffer, dst: &mut CudaBuffer, bytes: usize) -> Result<()> {
        self.copy_between(src, dst, bytes)
    }

    fn copy_within(
        &self,
        buf: &mut CudaBuffer,
        src: usize,
        dst: usize,
        bytes: usize,
    ) -> Result<()> {
        self.copy_inside(buf, src, dst, bytes)
    }

    fn share(&self, buf: &CudaBuffer) -> Result<Option<SharedArea>> {
        self.lend(buf).map(Some)
    }

    fn open_shared(&self, area: &SharedArea) -> Result<super::shared::Borrowed> {
        self.borrow(area)
    }

    fn copy_shared(
        &self,
        view: &super::shared::Borrowed,
        area: &SharedArea,
        dst: &mut CudaBuffer,
    ) -> Result<()> {
        self.copy_borrowed(view, area, dst)
    }

    fn argmax_rows(
        &self,
        x: &CudaBuffer,
        n: usize,
        scratch: &mut CudaBuffer,
        out: &mut [u32],
    ) -> Result<()> {
        self.argmax_on_device(x, n, scratch, out)
    }

    fn top_rows(
        &self,
        x: &CudaBuffer,
        n: usize,
        k: usize,
        scratch: &mut CudaBuffer,
        out: &mut [Vec<(u32, f32)>],
    ) -> Result<()> {
        self.top_on_device(x, n, k, scratch, out)
    }

    fn score_rows(
        &self,
        x: &CudaBuffer,
        n: usize,
        targets: &[u32],
        scratch: &mut CudaBuffer,
        out: &mut [(f32, f32)],
    ) -> Result<()> {
        self.score_on_device(x, n, targets, scratch, out)
    }
}

impl CudaBackend {
    /// The device address `offset` bytes into `dst` where `len` bytes may be written, after
    /// the checks every upload path shares (not a packed weight, inside the buffer).
    fn upload_target(&self, dst: &CudaBuffer, offset: usize, len: usize) -> Result<u64> {
        if dst.packed {
            return Err(shape_err(
                "upload",
                "the buffer holds a finished weight in the packed layout; it cannot be written again".to_string(),
            ));
        }
        self.wrote();
        need(
            "upload",
            "destination buffer",
            dst.bytes(),
            offset.checked_add(len),
        )?;
        Ok(self.addr("upload", "destination buffer", dst)? + offset as u64)
    }
}
