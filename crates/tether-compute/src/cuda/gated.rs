//! Gated feed-forwards on the GPU (SiLU or Gemma's GELU: the fused gate/up product kernels
//! take their activation as an argument), and Gemma's embedding scale and soft-capping.

use super::check::{f32s, shape_err};
use super::launch::{Arg, grid_for};
use super::{CudaBackend, CudaBuffer};
use crate::backend::{Backend, GateAct, Result, Weight};
use crate::operands::gate_up_shape;

/// Device addresses and sizes of one checked gate/up product with its activation (one
/// launch of the fused kernels).
pub(crate) struct GatedOperands {
    pub gate: u64,
    pub up: u64,
    pub rows: usize,
    pub cols: usize,
    pub x: u64,
    pub n_tokens: usize,
    pub out: u64,
}

/// Threads per block of the element-wise kernels here.
const THREADS: u32 = 256;

/// The `act` argument of the gate/up kernels (`GATE_SILU`, `GATE_GELU_TANH` in
/// common.cuh).
pub(super) fn kernel_code(act: GateAct) -> i32 {
    match act {
        GateAct::Silu => 0,
        GateAct::GeluTanh => 1,
    }
}

impl CudaBackend {
    /// `out = act(gate · x) · (up · x)`: one fused launch where a matvec family takes both
    /// weights at this size, else two products and the element-wise activation.
    pub(super) fn gated_product(
        &self,
        act: GateAct,
        gate_up: [Weight<'_, CudaBuffer>; 2],
        x: &CudaBuffer,
        n_tokens: usize,
        out: &mut CudaBuffer,
        [gate_tmp, up_tmp]: [&mut CudaBuffer; 2],
    ) -> Result<()> {
        let (rows, cols) = gate_up_shape("matmul", gate_up)?;
        let [gate, up] = gate_up;
        let family = self.fused_family([(gate.buf, gate.ty), (up.buf, up.ty)], cols, n_tokens);
        let Some(family) = family else {
            if self.grouped_gated(act, gate_up, x, n_tokens, out)? {
                return Ok(());
            }
            self.matmul(gate, x, n_tokens, gate_tmp)?;
            self.matmul(up, x, n_tokens, up_tmp)?;
            return self.gated(act, gate_tmp, up_tmp, n_tokens * rows, out);
        };
        let (gp, xp, op) = self.matmul_operands(gate, x, n_tokens, out)?;
        let (up_p, _, _) = self.matmul_operands(up, x, n_tokens, out)?;
        if rows == 0 || n_tokens == 0 {
            return Ok(());
        }
        let operands = GatedOperands {
            gate: gp,
            up: up_p,
            rows,
            cols,
            x: xp,
            n_tokens,
            out: op,
        };
        self.matvec_swiglu(act, family, operands)
    }

    /// `out[i] = act(gate[i]) · up[i]` by the element-wise kernel of `act`.
    pub(super) fn gated_elementwise(
        &self,
        act: GateAct,
        gate: &CudaBuffer,
        up: &CudaBuffer,
        n: usize,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let op = match act {
            GateAct::Silu => "swiglu",
            GateAct::GeluTanh => "geglu",
        };
        f32s(op, "gate", gate, n)?;
        f32s(op, "up", up, n)?;
        f32s(op, "output", out, n)?;
        let (g, u) = (self.addr(op, "gate", gate)?, self.addr(op, "up", up)?);
        let o = self.addr(op, "output", out)?;
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::Ptr(g), Arg::Ptr(u), Arg::U64(n as u64), Arg::Ptr(o)];
        self.run(op, grid_for(n, THREADS), &args)
    }

    /// `x[i] *= factor` (`kernel` "scale") or `x[i] = cap · tanh(x[i] / cap)` ("softcap").
    pub(super) fn scalar_op(
        &self,
        kernel: &'static str,
        x: &mut CudaBuffer,
        n: usize,
        value: f32,
    ) -> Result<()> {
        if kernel == "softcap" && !(value.is_finite() && value > 0.0) {
            return Err(shape_err(
                "softcap",
                format!("soft-cap {value} must be a positive number"),
            ));
        }
        f32s(kernel, "x", x, n)?;
        let xp = self.addr(kernel, "x", x)?;
        if n == 0 {
            return Ok(());
        }
        let args = [Arg::Ptr(xp), Arg::U64(n as u64), Arg::F32(value)];
        self.run(kernel, grid_for(n, THREADS), &args)
    }
}
