//! Q4_0 and Q8_0 weights after `finish_weight`, which packs them on the GPU (the cpu keeps
//! GGUF's layout): every op that reads a weight gives the cpu's results, for decode
//! batches (packed products) and prefill batches (GEMM), fused or not; and the grouped
//! products of decode batches over every type the GEMM decodes.
//!
//! GPU tests, ignored by default: `cargo test -p tether-compute --test cuda_packed --
//! --ignored`. Without a GPU they fail.

use tether_compute::Weight;
use tether_compute::{Backend, CpuBackend, CudaBackend};
use tether_gguf::GgmlType;

mod common;
use common::fused::{Finished, Rig, finished, relative_error, zeros};
use common::{Rng, cpu, f32_bytes, get, gpu, put, random_weights};

#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_weights_give_the_cpus_products() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(31);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
        // 288 values are 9 blocks, not whole groups of 8: left unpacked.
        for (cols, packs) in [(256usize, true), (4096, true), (14336, true), (288, false)] {
            let rows = 67;
            let bytes = random_weights(&mut rng, ty, rows * cols);
            let w = finished(&g, &c, ty, &bytes, cols);
            assert_eq!(w.packed, packs, "{ty} {rows}x{cols}: packed");
            // 8-48 tokens take the tensor cores (launches of up to 32: 40 is 32 + 8), fewer
            // dp4a, 64 and 65 the GEMM.
            let mut rig = Rig {
                g: &g,
                c: &c,
                rng: &mut rng,
                cols,
                expect_packed: false,
            };
            rig.products(&w, ty, rows, &[1, 2, 3, 8, 13, 24, 40, 64, 65], 1e-2);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn grouped_products_of_decode_batches_give_the_cpus() {
    // Batches of 16-64 tokens over the weights the GEMM decodes take q/k/v and gate/up in
    // one launch of its narrow tiles (gemm_grouped.rs) where every boundary between the
    // weights is a whole 128-row tile: 256 + 128 + 128 and 128 + 128 + 72 rows here, and
    // gate/up of 256 (72 rows ends inside a tile and takes the products one by one). 16
    // and 24 tokens are the 32-token tile, 33 and 64 the 64-token one.
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(43);
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::IQ4XS,
    ] {
        let mut rig = Rig {
            g: &g,
            c: &c,
            rng: &mut rng,
            cols: 2048,
            expect_packed: false,
        };
        let tokens = [16usize, 24, 33, 64];
        rig.qkv_shaped([ty; 3], [256, 128, 128], &tokens, 2e-2);
        // v's last row tile is partial (its rows past 72 repeat the last and are dropped).
        rig.qkv_shaped([ty; 3], [128, 128, 72], &tokens, 2e-2);
        rig.gate_up_down(ty, &tokens, 2e-2, 5e-2);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn packed_weights_give_the_cpus_fused_products_and_rows() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(37);
    for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
        let cols = 512;
        let mut rig = Rig {
            g: &g,
            c: &c,
            rng: &mut rng,
            cols,
            expect_packed: true,
        };
        let tokens = [1usize, 5, 8, 12];
        rig.qkv([ty; 3], &tokens, 1e-2);
        rig.gate_up_down(ty, &tokens, 1e-2, 1e-2);

        // Embedding rows come out of a packed table exactly as the cpu decodes them.
        rig.embedding_rows(ty);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_finished_weight_cannot_be_written_and_mixed_layouts_still_multiply() {
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(41);
    let ty = GgmlType::Q4_0;
    let cols = 512;
    let bytes = random_weights(&mut rng, ty, 64 * cols);
    let mut w = finished(&g, &c, ty, &bytes, cols);
    assert!(w.packed);
    assert!(
        g.upload(&mut w.g, 0, &bytes[..64]).is_err(),
        "a packed weight took a write"
    );
    // Finishing twice leaves it as it is.
    let mut first = vec![0u8; bytes.len()];
    g.download(&w.g, 0, &mut first).unwrap();
    g.finish_weight(&mut w.g, ty, cols).unwrap();
    let mut again = vec![0u8; bytes.len()];
    g.download(&w.g, 0, &mut again).unwrap();
    assert_eq!(
        again, first,
        "a second finish_weight packed the packed bytes again"
    );

    // q packed, k and v not: the three products run apart and still agree.
    let plain = (put(&g, &bytes), put(&c, &bytes));
    let x = rng.f32s(cols, 1.0);
    let (xg, xc) = (put(&g, &f32_bytes(&x)), put(&c, &f32_bytes(&x)));
    let mut og: Vec<_> = (0..3).map(|_| g.alloc(64 * 4).unwrap()).collect();
    let mut oc: Vec<_> = (0..3).map(|_| c.alloc(64 * 4).unwrap()).collect();
    let [g0, g1, g2] = &mut og[..] else {
        unreachable!()
    };
    g.matmul3(
        [
            Weight::new(&w.g, ty, 64, cols),
            Weight::new(&plain.0, ty, 64, cols),
            Weight::new(&plain.0, ty, 64, cols),
        ],
        &xg,
        1,
        [g0, g1, g2],
    )
    .unwrap();
    let [c0, c1, c2] = &mut oc[..] else {
        unreachable!()
    };
    c.matmul3(
        [
            Weight::new(&w.c, ty, 64, cols),
            Weight::new(&plain.1, ty, 64, cols),
            Weight::new(&plain.1, ty, 64, cols),
        ],
        &xc,
        1,
        [c0, c1, c2],
    )
    .unwrap();
    for i in 0..3 {
        let what = format!("mixed matmul3 output {i}");
        let e = relative_error(&what, &get(&g, &og[i], 64), &get(&c, &oc[i], 64));
        assert!(e < 1e-2, "{what}: relative error {e}");
    }
}

type GpuBuffer = <CudaBackend as Backend>::Buffer;

/// A feed-forward block's finished weights and scratch on the GPU, for recorded steps.
struct FeedForward {
    ty: GgmlType,
    e: usize,
    ff: usize,
    gate: Finished,
    up: Finished,
    down: Finished,
    norm: GpuBuffer,
    /// normed, act and the two fallback products.
    scratch: [GpuBuffer; 4],
}

impl FeedForward {
    fn new(
        g: &CudaBackend,
        c: &CpuBackend,
        rng: &mut Rng,
        ty: GgmlType,
        e: usize,
        ff: usize,
    ) -> Self {
        let gate = finished(g, c, ty, &random_weights(rng, ty, ff * e), e);
        let up = finished(g, c, ty, &random_weights(rng, ty, ff * e), e);
        let down = finished(g, c, ty, &random_weights(rng, ty, e * ff), ff);
        assert!(gate.packed && down.packed);
        let norm = put(g, &f32_bytes(&rng.f32s(e, 1.0)));
        let scratch = [zeros(g, e), zeros(g, ff), zeros(g, ff), zeros(g, ff)];
        Self {
            ty,
            e,
            ff,
            gate,
            up,
            down,
            norm,
            scratch,
        }
    }

    /// `layers` blocks over `hidden` (three launches each).
    fn run(
        &mut self,
        g: &CudaBackend,
        hidden: &mut GpuBuffer,
        layers: usize,
    ) -> tether_compute::Result<()> {
        let (ty, e, ff) = (self.ty, self.e, self.ff);
        let [normed, act, t1, t2] = &mut self.scratch;
        for _ in 0..layers {
            g.rms_norm(hidden, &self.norm, 1, e, 1e-5, normed)?;
            g.matmul_swiglu(
                [
                    Weight::new(&self.gate.g, ty, ff, e),
                    Weight::new(&self.up.g, ty, ff, e),
                ],
                normed,
                1,
                act,
                [t1, t2],
            )?;
            g.matmul_add(Weight::new(&self.down.g, ty, e, ff), act, 1, hidden, normed)?;
        }
        Ok(())
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn repeated_decode_steps_are_replayed_from_one_graph() {
    // A layer's feed-forward as a recorded step, with an output-head-like norm and product
    // between steps (outside the step, as the generator runs them): steps after the first
    // must repeat their launches exactly, so that one captured graph replays them.
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(43);
    let (ty, e, ff, vocab) = (GgmlType::Q4_0, 256usize, 512usize, 64usize);
    let mut block = FeedForward::new(&g, &c, &mut rng, ty, e, ff);
    let head = finished(&g, &c, ty, &random_weights(&mut rng, ty, vocab * e), e);
    assert!(head.packed);
    let start = f32_bytes(&rng.f32s(e, 1.0));
    let mut hidden = put(&g, &start);
    let (mut normed, mut logits) = (zeros(&g, e), zeros(&g, vocab));
    let mut replays = tether_compute::CudaReplays::default();
    let mut results = Vec::new();
    for _ in 0..5 {
        g.upload(&mut hidden, 0, &start).unwrap();
        g.replay(&mut replays, 1, || block.run(&g, &mut hidden, 1))
            .unwrap()
            .unwrap();
        g.rms_norm(&hidden, &block.norm, 1, e, 1e-5, &mut normed)
            .unwrap();
        g.matmul(Weight::new(&head.g, ty, vocab, e), &normed, 1, &mut logits)
            .unwrap();
        results.push((get(&g, &hidden, e), get(&g, &logits, vocab)));
    }
    assert_eq!(
        replays.graphs(),
        1,
        "the repeated step is one captured graph"
    );
    for r in &results[1..] {
        assert_eq!(
            r, &results[0],
            "a replayed step gives what the first one gave"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_long_step_is_replayed_in_pieces_that_give_the_eager_results() {
    // Enough launches that a recorded step is issued in several pieces, each captured on
    // its own (graph.rs): every replayed step must give what the same ops give issued one
    // by one, outside any step.
    let (g, c) = (gpu(), cpu());
    let mut rng = Rng(47);
    let (e, layers) = (256usize, 30usize);
    let mut block = FeedForward::new(&g, &c, &mut rng, GgmlType::Q8_0, e, 512);
    let start = f32_bytes(&rng.f32s(e, 1.0));
    let mut hidden = put(&g, &start);
    block.run(&g, &mut hidden, layers).unwrap();
    let eager = get(&g, &hidden, e);
    assert!(eager.iter().all(|v| v.is_finite()), "eager run overflowed");
    let mut replays = tether_compute::CudaReplays::default();
    for step in 0..4 {
        g.upload(&mut hidden, 0, &start).unwrap();
        g.replay(&mut replays, 1, || block.run(&g, &mut hidden, layers))
            .unwrap()
            .unwrap();
        assert_eq!(
            get(&g, &hidden, e),
            eager,
            "step {step} differs from the same ops issued one by one"
        );
    }
    // At least 90 launches: pieces of 12, 48, then up to 192, each its own graph.
    let graphs = replays.graphs();
    assert!(
        (3..=4).contains(&graphs),
        "{graphs} graphs: the step's pieces are not captured one by one"
    );
}
