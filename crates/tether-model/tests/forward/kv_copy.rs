//! Copying a sequence's first positions into another sequence (prefix reuse): the copy then
//! continues exactly as the source would, for every KV cache type, and a refused copy
//! changes nothing.

use tether_compute::CpuBackend;
use tether_gguf::GgmlType;
use tether_model::{BatchToken, SynthShape, load_stage_from_file};

use crate::support::{TempModel, backend, run, spec, synth};

const IDS: [u32; 12] = [1, 300, 17, 260, 45, 299, 3, 270, 288, 100, 7, 42];
const OTHER: [u32; 9] = [5, 6, 7, 8, 9, 10, 11, 12, 13];

fn at(seq: u32, positions: std::ops::Range<u32>) -> Vec<BatchToken> {
    positions.map(|pos| BatchToken { seq, pos }).collect()
}

fn stage(m: &TempModel, cache: GgmlType) -> tether_model::Stage<CpuBackend> {
    let n = tether_model::ModelConfig::from_gguf(&m.file)
        .unwrap()
        .n_layer;
    let mut s = spec(0, n, true, true, 3, 16);
    s.cache_k = cache;
    s.cache_v = cache;
    load_stage_from_file(backend(), &m.file, s).unwrap()
}

#[test]
fn a_copied_prefix_continues_as_its_source_does() {
    let m = synth(SynthShape::Tiny, GgmlType::Q8_0, 3);
    for cache in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0] {
        let mut st = stage(&m, cache);
        run(&mut st, &IDS, &at(0, 0..12));
        // The destination held something else: the copy replaces it.
        run(&mut st, &OTHER, &at(2, 0..9));
        st.kv_truncate(0, 7).unwrap();
        let want = run(&mut st, &IDS[7..], &at(0, 7..12));
        st.kv_copy(0, 2, 7).unwrap();
        assert_eq!(st.seq_len(2).unwrap(), 7);
        assert_eq!(
            st.seq_len(0).unwrap(),
            12,
            "{cache}: the source keeps its cells"
        );
        let got = run(&mut st, &IDS[7..], &at(2, 7..12));
        assert_eq!(got, want, "{cache}: the copy goes on as its source");
    }
}

#[test]
fn a_refused_copy_changes_nothing() {
    let m = synth(SynthShape::Tiny, GgmlType::Q8_0, 3);
    let mut st = stage(&m, GgmlType::F16);
    run(&mut st, &IDS[..4], &at(0, 0..4));
    run(&mut st, &OTHER[..3], &at(1, 0..3));
    for (src, dst, len) in [(0, 1, 5), (0, 0, 2), (0, 3, 2), (3, 1, 0)] {
        let err = st.kv_copy(src, dst, len).unwrap_err().to_string();
        assert!(!err.is_empty());
        assert_eq!(
            (st.seq_len(0).unwrap(), st.seq_len(1).unwrap()),
            (4, 3),
            "copy {src} -> {dst} of {len}: {err}"
        );
    }
    st.kv_copy(0, 1, 0).unwrap();
    assert_eq!(
        st.seq_len(1).unwrap(),
        0,
        "an empty copy empties the destination"
    );
}
