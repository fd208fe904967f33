//! The hidden states an embedding pools (`Stage::output_normed`) against the f64
//! reference's `last_hidden_state`, over the architectures with different final norms.

use tether_gguf::GgmlType;
use tether_model::{BatchToken, SynthShape};

use crate::reference_model::{Reference, relative_error};
use crate::support::{synth, whole};

const IDS: [u32; 10] = [1, 300, 17, 260, 45, 299, 3, 270, 288, 100];

#[test]
fn normed_hidden_states_match_the_reference() {
    // Gemma's norm gain is stored as (1 + w), Qwen3 normalizes q and k per head: each
    // changes what reaches the final norm.
    for (shape, seed) in [
        (SynthShape::Tiny, 3),
        (SynthShape::TinyQwen3, 4),
        (SynthShape::TinyGemma3, 5),
    ] {
        let m = synth(shape, GgmlType::F32, seed);
        let mut stage = whole(&m.file, 1, 4);
        let e = stage.config().n_embd;
        let toks: Vec<BatchToken> = (0..IDS.len() as u32)
            .map(|pos| BatchToken { seq: 0, pos })
            .collect();
        let mut h = vec![0.0; IDS.len() * e];
        stage.embed(&IDS, &mut h).unwrap();
        stage.forward(&toks, &mut h).unwrap();
        let mut got = vec![0.0; IDS.len() * e];
        stage.output_normed(&h, IDS.len(), &mut got).unwrap();
        let want = Reference::load(&m.file).normed_hidden(&IDS);
        for (pos, row) in want.iter().enumerate() {
            let err = relative_error(&got[pos * e..(pos + 1) * e], row);
            assert!(
                err < 1e-4,
                "{shape:?}: position {pos}: relative error {err:e}"
            );
        }
    }
}

#[test]
fn a_stage_without_the_head_refuses_to_norm() {
    let m = synth(SynthShape::Tiny, GgmlType::F32, 3);
    let mut stage = tether_model::load_stage_from_file(
        crate::support::backend(),
        &m.file,
        crate::support::spec(0, 1, true, false, 1, 4),
    )
    .unwrap();
    let e = stage.config().n_embd;
    let mut out = vec![0.0; e];
    assert!(stage.output_normed(&vec![0.0; e], 1, &mut out).is_err());
}
