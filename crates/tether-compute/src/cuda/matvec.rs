//! Matrix-vector products for small batches (decode): one launch per group of at most
//! [`MV_MAX_TOKENS`] tokens, each reading every weight once.
//!
//! Q4_0 and packed Q8_0 weights meet activations quantized to 8-bit blocks (as the cpu
//! backend does), multiplied with 4-way integer dot products: the activation row then costs
//! a quarter of its f32 bytes per weight row read, which is what bounded the f32 kernel
//! (2.2 TB/s of weights instead of 1.4 on an H100). The 8-bit copy lives in one of two
//! slots of a buffer the backend holds; ops that produce a product's input (the norms, the
//! attention merge, the packed gate/up kernel) write it as they go.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;

use cudarc::driver::LaunchConfig;
use tether_gguf::GgmlType;

use super::check::shape_err;
use super::gated::{GatedOperands, kernel_code};
use super::kernel_files::{define, source};
use super::launch::{Arg, int};
use super::packed::packed_stem;
use super::{CudaBackend, CudaBuffer};
use crate::backend::{GateAct, Result, Weight};

/// Weight rows per matvec block (one warp each: `MV_WARPS` in matvec.cu).
const MV_ROWS_PER_BLOCK: usize = define(source::MATVEC, "MV_WARPS");
/// Rows per block of the K-quant kernels (`PK_MV_WARPS` warps of `KQ_R` rows).
const KQ_ROWS_PER_BLOCK: usize =
    define(source::COMMON, "PK_MV_WARPS") * define(source::MATVEC_KQUANT, "KQ_R");
/// Most tokens one matvec launch multiplies; larger batches are split.
pub(crate) const MV_MAX_TOKENS: usize = 8;
/// Widest activation row the 8-bit path takes; wider rows use the f32 kernels.
pub(super) const XQ_MAX_COLS: usize = 1 << 16;
/// Bytes of one slot of the quantized-activation buffer: `MV_MAX_TOKENS` rows of int8
/// values, then one (scale, scaled sum) f32 pair per 32 values.
const XQ_SLOT_BYTES: usize = XQ_SCALES_AT + MV_MAX_TOKENS * (XQ_MAX_COLS / 32) * 8;
/// Slots of that buffer: a product that writes the 8-bit copy of its output (gate/up)
/// reads its input's copy from the other one.
const XQ_SLOTS: usize = 2;
/// Bytes of the quantized-activation buffer.
pub(crate) const XQ_BYTES: usize = XQ_SLOTS * XQ_SLOT_BYTES;
/// Where the (scale, scaled sum) pairs start in a slot; also the most 8-bit values a slot
/// holds.
pub(super) const XQ_SCALES_AT: usize = MV_MAX_TOKENS * XQ_MAX_COLS;
/// Rows the gate/up kernel gives one block (`PK_SW_ROWS`): one 8-bit block of its output
/// per token.
const PK_SWIGLU_ROWS_PER_BLOCK: usize = define(source::COMMON, "PK_SW_ROWS");
/// Rows one block of the tensor-core products takes (`MQ_ROWS` in matvec_mma.cu), and its
/// warps (`MQ_WARPS`), which split the columns.
const MMA_ROWS_PER_BLOCK: usize = define(source::MATVEC_MMA, "MQ_ROWS");
const MMA_WARPS: u32 = define(source::MATVEC_MMA, "MQ_WARPS") as u32;
/// Launches of at least this many tokens multiply packed weights on the int8 tensor cores
/// (matvec_mma.cu) instead of with dp4a, on devices of compute capability 8.0 and later.
/// On an H100 (llama3-8b, `tether bench --parallel`), Q4_0 / Q8_0 decode steps of 8 tokens
/// went from 1,170 / 984 to 1,524 / 1,128 t/s; steps of 2 and 4 tokens were faster with
/// dp4a (673 / 947 against 505 / 903 for Q4_0).
pub(crate) const MMA_MIN_TOKENS: usize = 8;
/// Most tokens one tensor-core launch takes (4 tiles of 8, which share every block of
/// weights it loads); larger batches are split.
const MMA_MAX_TOKENS: usize = 32;
/// Output rows of one warp of the packed kernels (`PK_R`).
const PK_ROWS_PER_WARP: usize = define(source::MATVEC_PACKED, "PK_R");
/// Rows of one block of the packed matvec and q/k/v kernels (`PK_MV_WARPS` warps).
const PK_MV_ROWS_PER_BLOCK: usize = define(source::COMMON, "PK_MV_WARPS") * PK_ROWS_PER_WARP;

/// (input address, cols, tokens, write epoch) of the rows a slot holds: matmuls of one
/// input (q, k, v; gate, up) quantize it once, until any op writes device memory.
type XqKey = (u64, usize, usize, u64);

/// The quantized-activation buffer and what each slot holds.
pub(crate) struct Xq {
    buf: CudaBuffer,
    holds: [Option<XqKey>; XQ_SLOTS],
    /// The slot written last: writers take the other one, so the copy just made stays.
    newest: usize,
}

impl Xq {
    pub(crate) fn new(buf: CudaBuffer) -> Self {
        Self {
            buf,
            holds: [None; XQ_SLOTS],
            newest: XQ_SLOTS - 1,
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        crate::backend::DeviceBuffer::bytes(&self.buf)
    }

    /// Forgets what the slots hold and starts writing at slot 0 again: a decode step then
    /// puts every 8-bit copy where it did last time, so its launches (and their addresses)
    /// repeat and graph.rs can replay them.
    pub(crate) fn restart(&mut self) {
        self.holds = [None; XQ_SLOTS];
        self.newest = XQ_SLOTS - 1;
    }

    /// (values, scales) addresses of slot `s`.
    fn slot(&self, s: usize) -> (u64, u64) {
        let base = self.buf.ptr() + (s * XQ_SLOT_BYTES) as u64;
        (base, base + XQ_SCALES_AT as u64)
    }

    /// The slot to write next (not the newest one), emptied.
    fn take_for_write(&mut self) -> usize {
        let s = (self.newest + 1) % XQ_SLOTS;
        self.holds[s] = None;
        s
    }

    fn written(&mut self, s: usize, key: XqKey) {
        self.holds[s] = Some(key);
        self.newest = s;
    }
}

/// A locked 8-bit copy of some rows: the addresses of its values and scales.
struct QuantizedInput<'a> {
    guard: MutexGuard<'a, Xq>,
    slot: usize,
    q: u64,
    ds: u64,
}

/// Device addresses and sizes of one checked matmul, for the matvec kernels or the GEMM.
pub(crate) struct MatmulArgs {
    pub w: u64,
    pub ty: GgmlType,
    /// Whether `w` is in the packed layout (packed.rs).
    pub packed: bool,
    pub rows: usize,
    pub cols: usize,
    pub x: u64,
    pub n_tokens: usize,
    pub out: u64,
    /// Add into `out` instead of overwriting it.
    pub accumulate: bool,
}

impl MatmulArgs {
    /// The product of weight `w` whose operands `matmul_operands` checked: (weight, input,
    /// output) addresses.
    pub(super) fn of(
        w: Weight<'_, CudaBuffer>,
        (wp, xp, op): (u64, u64, u64),
        n_tokens: usize,
        accumulate: bool,
    ) -> Self {
        Self {
            w: wp,
            ty: w.ty,
            packed: w.buf.packed,
            rows: w.rows,
            cols: w.cols,
            x: xp,
            n_tokens,
            out: op,
            accumulate,
        }
    }
}

/// Which kernels run a decode product fused with others (q/k/v; gate and up): the
/// packed-layout ones (`matvecp…`) or the K-quant ones (`matveck…`) of one type, or the
/// GGUF-layout Q4_0 ones (`matvecq…`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Fused {
    prefix: &'static str,
    stem: &'static str,
}

impl Fused {
    /// Whether the kernels take the launch shapes and arguments of the drivers in
    /// common.cuh (the packed and K-quant families do).
    fn packed(&self) -> bool {
        matches!(self.prefix, "matvecp" | "matveck")
    }
}

/// The name stem of the matvec kernels for `ty`.
pub(super) fn stem(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        // kernels/matvec_more.cu
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_1 => "q8_1",
        GgmlType::Q2K => "q2_k",
        GgmlType::Q3K => "q3_k",
        GgmlType::Q8K => "q8_k",
        GgmlType::IQ4NL => "iq4_nl",
        GgmlType::IQ4XS => "iq4_xs",
    })
}

/// Whether products of `ty` weights (`packed` as stored), `cols` wide, take the 8-bit
/// K-quant kernels (matvec_kquant.cu): Q4_K and Q5_K as GGUF stores them, Q6_K, Q3_K and
/// IQ4_XS packed. On
/// an H100 they replace f32-activation kernels that read 4 weight bytes a lane.
pub(super) fn kquant_int8(ty: GgmlType, packed: bool, cols: usize) -> bool {
    let fits = cols > 0 && cols.is_multiple_of(256) && cols <= XQ_MAX_COLS;
    fits && match ty {
        GgmlType::Q4K | GgmlType::Q5K => !packed,
        GgmlType::Q6K | GgmlType::Q3K | GgmlType::IQ4XS => packed,
        _ => false,
    }
}

/// (q/k type, v type, kernel stem) of the mixed q/k/v kernels in matvec_kquant.cu
/// (KQ3_MIXED_ALL).
const MIXED_QKV: [(GgmlType, GgmlType, &str); 5] = [
    (GgmlType::Q4K, GgmlType::Q6K, "q4_k_q6_k"),
    (GgmlType::Q5K, GgmlType::Q6K, "q5_k_q6_k"),
    (GgmlType::Q3K, GgmlType::Q4K, "q3_k_q4_k"),
    (GgmlType::Q3K, GgmlType::Q5K, "q3_k_q5_k"),
    (GgmlType::IQ4XS, GgmlType::Q5K, "iq4_xs_q5_k"),
];

/// Blocks of `per_block` rows that cover `rows`, as a grid dimension.
fn blocks(op: &'static str, rows: usize, per_block: usize) -> Result<u32> {
    u32::try_from(rows.div_ceil(per_block))
        .map_err(|_| shape_err(op, format!("{rows} rows are too many for one launch")))
}

impl CudaBackend {
    /// Marks that device memory may have changed: quantized inputs must be made again.
    pub(super) fn wrote(&self) {
        self.write_epoch.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn lock_xq(&self) -> MutexGuard<'_, Xq> {
        // The buffer holds no state between ops, so a poisoned lock is still usable.
        self.xq.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `out[t] = w · x[t]` for every token, in launches of at most [`MV_MAX_TOKENS`].
    pub(super) fn matvec(&self, a: MatmulArgs) -> Result<()> {
        const OP: &str = "matmul";
        let stem = stem(a.ty).ok_or_else(|| super::check::unsupported(OP, a.ty))?;
        let (rows_arg, cols_arg) = (int(OP, "rows", a.rows)?, int(OP, "cols", a.cols)?);
        // Packed weights, K-quants and GGUF-layout Q4_0 take 8-bit activations; the rest
        // take f32.
        let packed = a.packed && packed_stem(a.ty).is_some();
        let kquant = kquant_int8(a.ty, a.packed, a.cols);
        let int8 = packed
            || kquant
            || (a.ty == GgmlType::Q4_0 && a.cols.is_multiple_of(32) && a.cols <= XQ_MAX_COLS);
        let (prefix, per_block) = if packed {
            ("matvecp", PK_MV_ROWS_PER_BLOCK)
        } else if kquant {
            ("matveck", KQ_ROWS_PER_BLOCK)
        } else if int8 {
            ("matvecq", MV_ROWS_PER_BLOCK)
        } else {
            ("matvec", MV_ROWS_PER_BLOCK)
        };
        let cfg = LaunchConfig {
            grid_dim: (blocks(OP, a.rows, per_block)?, 1, 1),
            // Both families run 4 warps a block.
            block_dim: (32 * MV_ROWS_PER_BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut t0 = 0;
        while t0 < a.n_tokens {
            // Launches of enough tokens over packed weights take the tensor cores, up to
            // MMA_MAX_TOKENS at once (as many as the 8-bit copy's slot holds rows of).
            let left = a.n_tokens - t0;
            let mma = packed && left.min(MV_MAX_TOKENS) >= self.mma_min_tokens;
            let most = if mma {
                (XQ_SCALES_AT / a.cols).clamp(MV_MAX_TOKENS, MMA_MAX_TOKENS)
            } else {
                MV_MAX_TOKENS
            };
            let n = left.min(most);
            let width = n.next_power_of_two();
            let x = a.x + (t0 * a.cols * 4) as u64;
            let out = a.out + (t0 * a.rows * 4) as u64;
            if int8 {
                let (name, cfg) = if mma {
                    let mma = LaunchConfig {
                        grid_dim: (blocks(OP, a.rows, MMA_ROWS_PER_BLOCK)?, 1, 1),
                        block_dim: (32 * MMA_WARPS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    (
                        format!("matvec_mma_{stem}_{}", width.max(MV_MAX_TOKENS)),
                        mma,
                    )
                } else {
                    (format!("{prefix}_{stem}_{width}"), cfg)
                };
                let xin = self.quantized_input(x, a.cols, n)?;
                let args = [
                    Arg::Ptr(a.w),
                    rows_arg,
                    cols_arg,
                    Arg::Ptr(xin.q),
                    Arg::Ptr(xin.ds),
                    Arg::I32(n as i32),
                    Arg::Ptr(out),
                    Arg::I32(i32::from(a.accumulate)),
                ];
                // Not `run`: the output is never the quantized input, which stays valid.
                self.launch_kernel(&name, cfg, &args)?;
            } else {
                let args = [
                    Arg::Ptr(a.w),
                    rows_arg,
                    cols_arg,
                    Arg::Ptr(x),
                    Arg::I32(n as i32),
                    Arg::Ptr(out),
                    Arg::I32(i32::from(a.accumulate)),
                ];
                self.run(&format!("{prefix}_{stem}_{width}"), cfg, &args)?;
            }
            t0 += n;
        }
        Ok(())
    }

    /// Three products of one input in one launch (attention's q, k and v): the small k
    /// and v matrices alone leave most of the GPU idle. `m[i]` is (weights, output).
    pub(super) fn matvec3(
        &self,
        family: Fused,
        m: [(u64, u64); 3],
        rows: [usize; 3],
        cols: usize,
        x: u64,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "matmul";
        // Packed kernels give each matrix its own blocks; the others number rows across all.
        let grid = if family.packed() {
            let per: usize = rows.iter().map(|r| r.div_ceil(PK_MV_ROWS_PER_BLOCK)).sum();
            blocks(OP, per, 1)?
        } else {
            blocks(OP, rows.iter().sum(), MV_ROWS_PER_BLOCK)?
        };
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (32 * MV_ROWS_PER_BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = vec![
            Arg::Ptr(m[0].0),
            Arg::Ptr(m[1].0),
            Arg::Ptr(m[2].0),
            int(OP, "rows", rows[0])?,
            int(OP, "rows", rows[1])?,
            int(OP, "rows", rows[2])?,
            int(OP, "cols", cols)?,
        ];
        // Held until the launch is queued (see `quantized_input`).
        let xin = self.quantized_input(x, cols, n)?;
        args.extend([Arg::Ptr(xin.q), Arg::Ptr(xin.ds)]);
        args.extend([
            Arg::I32(n as i32),
            Arg::Ptr(m[0].1),
            Arg::Ptr(m[1].1),
            Arg::Ptr(m[2].1),
        ]);
        let width = n.next_power_of_two();
        let Fused { prefix, stem } = family;
        let launched = self.launch_kernel(&format!("{prefix}3_{stem}_{width}"), cfg, &args);
        drop(xin);
        launched
    }

    /// Runs `launch`, an op that writes `n` rows of `cols` f32 at `x` and also their 8-bit
    /// copy at the (values, scales) addresses it is given, and notes that the buffer holds
    /// that copy, so the matmuls that follow skip their quantize pass. Returns false (and
    /// runs nothing) when the rows do not fit the buffer.
    pub(super) fn writing_xq(
        &self,
        x: u64,
        cols: usize,
        n: usize,
        launch: impl FnOnce(u64, u64) -> Result<()>,
    ) -> Result<bool> {
        if n == 0
            || n > MV_MAX_TOKENS
            || cols == 0
            || !cols.is_multiple_of(32)
            || cols > XQ_MAX_COLS
        {
            return Ok(false);
        }
        let mut xq = self.lock_xq();
        let s = xq.take_for_write();
        let (q, ds) = xq.slot(s);
        launch(q, ds)?;
        // Read after the launch: the op's own write retired older copies.
        xq.written(s, (x, cols, n, self.write_epoch.load(Ordering::Relaxed)));
        Ok(true)
    }

    /// The 8-bit copy of `n` rows of `cols` at `x` (quantized now unless the buffer already
    /// holds them). The buffer stays locked until the returned value is dropped: launch the
    /// kernels that read it before then, or another thread's rows could be queued over it.
    fn quantized_input(&self, x: u64, cols: usize, n: usize) -> Result<QuantizedInput<'_>> {
        let mut guard = self.lock_xq();
        let key = (x, cols, n, self.write_epoch.load(Ordering::Relaxed));
        let slot = match guard.holds.iter().position(|h| *h == Some(key)) {
            Some(s) => s,
            None => {
                let s = guard.take_for_write();
                let (q, ds) = guard.slot(s);
                self.quantize_q8(x, cols, n, q, ds)?;
                guard.written(s, key);
                s
            }
        };
        let (q, ds) = guard.slot(slot);
        Ok(QuantizedInput { guard, slot, q, ds })
    }

    /// For an op that reads the 8-bit copy of `n` rows of `cols` at `x` (quantized now
    /// unless the buffer holds them) and may write the 8-bit copy of its own output, `out`
    /// = (address, cols, rows) of at most [`XQ_SCALES_AT`] values, into the other slot:
    /// `launch` gets the (values, scales) addresses of the input and of that slot, and must
    /// queue every kernel that reads them before it returns.
    pub(super) fn with_xq_in_out(
        &self,
        x: u64,
        cols: usize,
        n: usize,
        out: Option<(u64, usize, usize)>,
        launch: impl FnOnce((u64, u64), Option<(u64, u64)>) -> Result<()>,
    ) -> Result<()> {
        let mut xin = self.quantized_input(x, cols, n)?;
        let s = (xin.slot + 1) % XQ_SLOTS;
        let target = out.map(|_| {
            xin.guard.holds[s] = None;
            xin.guard.slot(s)
        });
        launch((xin.q, xin.ds), target)?;
        if let Some((at, out_cols, out_n)) = out {
            let key = (
                at,
                out_cols,
                out_n,
                self.write_epoch.load(Ordering::Relaxed),
            );
            xin.guard.written(s, key);
        }
        Ok(())
    }

    /// The fused decode kernels that take products of these weights (each with its type),
    /// `cols` wide, for `n_tokens`: the packed ones when all are packed and of one type, the
    /// GGUF-layout Q4_0 ones when all are unpacked Q4_0; `None` runs them one by one.
    pub(super) fn fused_family<const N: usize>(
        &self,
        weights: [(&CudaBuffer, GgmlType); N],
        cols: usize,
        n_tokens: usize,
    ) -> Option<Fused> {
        let sizes_fit =
            cols > 0 && cols.is_multiple_of(32) && cols <= XQ_MAX_COLS && n_tokens <= MV_MAX_TOKENS;
        let (first, ty) = *weights.first()?;
        // Batches the tensor cores take run as separate products.
        let on_mma = first.packed && packed_stem(ty).is_some() && n_tokens >= self.mma_min_tokens;
        if !sizes_fit
            || on_mma
            || weights
                .iter()
                .any(|&(w, t)| t != ty || w.packed != first.packed)
        {
            return None;
        }
        if kquant_int8(ty, first.packed, cols) {
            return stem(ty).map(|stem| Fused {
                prefix: "matveck",
                stem,
            });
        }
        match (first.packed, ty) {
            (true, _) => packed_stem(ty).map(|stem| Fused {
                prefix: "matvecp",
                stem,
            }),
            (false, GgmlType::Q4_0) => Some(Fused {
                prefix: "matvecq",
                stem: "q4_0",
            }),
            _ => None,
        }
    }

    /// The K-quant q/k/v kernel for q and k of one type and v of another (the mixes
    /// llama.cpp's quantizer writes give attn_v more bits), when one is built for the pair
    /// and all three take the K-quant kernels at this size.
    pub(super) fn mixed_qkv_family(
        &self,
        weights: [(&CudaBuffer, GgmlType); 3],
        cols: usize,
        n_tokens: usize,
    ) -> Option<Fused> {
        let [(q, qt), (k, kt), (v, vt)] = weights;
        let takes = |w: &CudaBuffer, t| kquant_int8(t, w.packed, cols);
        if qt != kt || n_tokens > MV_MAX_TOKENS || !(takes(q, qt) && takes(k, kt) && takes(v, vt)) {
            return None;
        }
        MIXED_QKV
            .iter()
            .find(|(a, b, _)| (*a, *b) == (qt, vt))
            .map(|&(_, _, stem)| Fused {
                prefix: "matveck",
                stem,
            })
    }

    /// `out[t] = act(gate · x[t]) · (up · x[t])` in one launch (at most
    /// [`MV_MAX_TOKENS`] tokens; see `fused_family`), `act` being silu or GELU-tanh.
    pub(super) fn matvec_swiglu(
        &self,
        act: GateAct,
        family: Fused,
        a: GatedOperands,
    ) -> Result<()> {
        const OP: &str = "matmul";
        let GatedOperands {
            gate,
            up,
            rows,
            cols,
            x,
            n_tokens: n,
            out,
        } = a;
        let packed = family.packed();
        let cfg = if packed {
            LaunchConfig {
                grid_dim: (blocks(OP, rows, PK_SWIGLU_ROWS_PER_BLOCK)?, 1, 1),
                block_dim: (
                    (32 * PK_SWIGLU_ROWS_PER_BLOCK / PK_ROWS_PER_WARP) as u32,
                    1,
                    1,
                ),
                shared_mem_bytes: 0,
            }
        } else {
            LaunchConfig {
                grid_dim: (blocks(OP, rows, MV_ROWS_PER_BLOCK)?, 1, 1),
                block_dim: (32 * MV_ROWS_PER_BLOCK as u32, 1, 1),
                shared_mem_bytes: 0,
            }
        };
        let mut args = vec![
            Arg::Ptr(gate),
            Arg::Ptr(up),
            int(OP, "rows", rows)?,
            int(OP, "cols", cols)?,
        ];
        // Held until the launch is queued (see `quantized_input`).
        let mut xin = self.quantized_input(x, cols, n)?;
        args.extend([Arg::Ptr(xin.q), Arg::Ptr(xin.ds)]);
        args.extend([Arg::I32(n as i32), Arg::Ptr(out)]);
        // The packed kernel also writes the 8-bit copy of whole 32-row blocks of its output
        // for the down projection, into the slot its input does not use.
        let out_slot = (packed && rows.is_multiple_of(32) && rows <= XQ_MAX_COLS)
            .then(|| (xin.slot + 1) % XQ_SLOTS);
        if packed {
            let (oq, ods) = match out_slot {
                Some(s) => {
                    xin.guard.holds[s] = None;
                    xin.guard.slot(s)
                }
                None => (0, 0),
            };
            args.extend([Arg::Ptr(oq), Arg::Ptr(ods)]);
        }
        args.push(Arg::I32(kernel_code(act)));
        let width = n.next_power_of_two();
        let Fused { prefix, stem } = family;
        self.launch_kernel(&format!("{prefix}_swiglu_{stem}_{width}"), cfg, &args)?;
        if let Some(s) = out_slot {
            let key = (out, rows, n, self.write_epoch.load(Ordering::Relaxed));
            xin.guard.written(s, key);
        }
        drop(xin);
        Ok(())
    }

    /// Quantizes `n` rows of `cols` f32 at `x` into 8-bit blocks at `q` with their scales
    /// and scaled sums at `ds`.
    pub(super) fn quantize_q8(&self, x: u64, cols: usize, n: usize, q: u64, ds: u64) -> Result<()> {
        const WARPS_PER_BLOCK: usize = 8;
        let warps = n * cols / 32;
        let cfg = LaunchConfig {
            grid_dim: (warps.div_ceil(WARPS_PER_BLOCK) as u32, 1, 1),
            block_dim: (32 * WARPS_PER_BLOCK as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let args = [
            Arg::Ptr(x),
            int("matmul", "cols", cols)?,
            Arg::I32(n as i32),
            Arg::Ptr(q),
            Arg::Ptr(ds),
        ];
        self.launch_kernel("quantize_q8", cfg, &args)
    }
}
