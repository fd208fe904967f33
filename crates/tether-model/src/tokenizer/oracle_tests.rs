//! llama.cpp's tokenizer test vectors (`tokenizers/` of the test data): every input must give exactly the
//! expected ids, and decoding must give the input back.

use std::path::PathBuf;
use std::time::Instant;

use super::{Tokenizer, TokenizerKind};

const SEPARATOR: &str = "\n__ggml_vocab_test__\n";

fn vectors_dir() -> Option<PathBuf> {
    tether_test_data::path("tokenizers")
}

/// Inputs as llama.cpp's test-tokenizer-0 reads them: each is the text before a separator
/// line, without the newline that ends it; text after the last separator is not an input.
fn split_inputs(all: &str) -> Vec<&str> {
    let mut inputs = Vec::new();
    let mut rest = all;
    while let Some(pos) = rest.find(SEPARATOR) {
        inputs.push(&rest[..pos]);
        rest = &rest[pos + SEPARATOR.len()..];
    }
    inputs
}

fn load(name: &str) -> Option<(Tokenizer, Vec<String>, Vec<Vec<u32>>)> {
    let dir = vectors_dir()?;
    let path = dir.join(name);
    let file = tether_gguf::GgufFile::open(&path)
        .unwrap_or_else(|e| panic!("opening {}: {e}", path.display()));
    let tokenizer = Tokenizer::from_gguf(&file)
        .unwrap_or_else(|e| panic!("building the tokenizer of {}: {e}", path.display()));
    let read = |ext: &str| {
        let p = dir.join(format!("{name}.{ext}"));
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
    };
    let inputs: Vec<String> = split_inputs(&read("inp"))
        .into_iter()
        .map(String::from)
        .collect();
    let expected: Vec<Vec<u32>> = read("out")
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| id.parse().unwrap_or_else(|e| panic!("bad id {id:?}: {e}")))
                .collect()
        })
        .collect();
    assert_eq!(
        inputs.len(),
        expected.len(),
        "{name}: .inp and .out disagree on the count"
    );
    Some((tokenizer, inputs, expected))
}

fn check_all(name: &str, kind: TokenizerKind) {
    let Some((tokenizer, inputs, expected)) = load(name) else {
        return;
    };
    assert_eq!(tokenizer.kind(), kind);
    let mut failures = Vec::new();
    for (input, want) in inputs.iter().zip(&expected) {
        // No input spells a special token, so special parsing must not change anything.
        for parse_special in [false, true] {
            let got = tokenizer.encode(input, false, parse_special);
            if &got != want {
                failures.push(format!(
                    "  {input:?} (parse_special={parse_special})\n    want {want:?}\n    got  {got:?}"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} vectors differ:\n{}",
        failures.len(),
        inputs.len(),
        failures.join("\n")
    );
}

#[test]
fn separator_handling_matches_test_tokenizer_0() {
    let all = "a b\n__ggml_vocab_test__\n\n__ggml_vocab_test__\n\n\n__ggml_vocab_test__\n";
    assert_eq!(split_inputs(all), ["a b", "", "\n"]);
}

#[test]
fn llama_spm_vectors_all_match() {
    check_all("ggml-vocab-llama-spm.gguf", TokenizerKind::Spm);
}

#[test]
fn gpt2_vectors_all_match() {
    check_all("ggml-vocab-gpt-2.gguf", TokenizerKind::Bpe);
}

#[test]
fn vectors_round_trip_through_decode() {
    for name in ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"] {
        let Some((tokenizer, inputs, _)) = load(name) else {
            return;
        };
        for input in &inputs {
            for add_bos in [false, true] {
                let ids = tokenizer.encode(input, add_bos, false);
                assert_eq!(&tokenizer.decode(&ids), input, "{name}, add_bos={add_bos}");
            }
        }
    }
}

#[test]
fn spm_file_metadata_is_read() {
    let Some((tokenizer, _, _)) = load("ggml-vocab-llama-spm.gguf") else {
        return;
    };
    assert_eq!(tokenizer.vocab_size(), 32000);
    assert_eq!(tokenizer.bos(), Some(1));
    assert_eq!(tokenizer.eos(), Some(2));
    assert!(tokenizer.is_eog(2) && !tokenizer.is_eog(1));
    assert!(tokenizer.add_bos_default());
    assert_eq!(tokenizer.encode("Hello", true, false)[0], 1);
    // Special parsing turns the literal "</s>" into EOS; without it the text is spelled out.
    assert_eq!(tokenizer.encode("a</s>", false, true).last(), Some(&2));
    assert!(!tokenizer.encode("a</s>", false, false).contains(&2));
}

#[test]
fn encoding_10kb_is_fast() {
    for name in ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"] {
        let Some((tokenizer, inputs, _)) = load(name) else {
            return;
        };
        let mut text = String::new();
        while text.len() < 10_000 {
            text.push_str(&inputs.join(" "));
        }
        let start = Instant::now();
        let ids = tokenizer.encode(&text, false, true);
        let elapsed = start.elapsed();
        eprintln!(
            "{name}: {} bytes -> {} tokens in {elapsed:?}",
            text.len(),
            ids.len()
        );
        assert_eq!(tokenizer.decode(&ids), text);
        // The target is well under 100 ms in release; the test profile is optimized too, and
        // the margin absorbs a busy shared machine.
        assert!(
            elapsed.as_millis() < 400,
            "{name}: encoding took {elapsed:?}"
        );
    }
}

#[test]
fn long_uniform_runs_encode_quickly() {
    for name in ["ggml-vocab-llama-spm.gguf", "ggml-vocab-gpt-2.gguf"] {
        let Some((tokenizer, _, _)) = load(name) else {
            return;
        };
        for unit in [" ", "a", "7", "\n", "é", "!", "\u{1F600}"] {
            let text = format!("{}x", unit.repeat(10_000 / unit.len()));
            let start = Instant::now();
            let ids = tokenizer.encode(&text, false, false);
            let elapsed = start.elapsed();
            assert_eq!(tokenizer.decode(&ids), text, "{name}: {unit:?} run");
            assert!(
                elapsed.as_millis() < 400,
                "{name}: {unit:?} run took {elapsed:?}"
            );
        }
    }
}
