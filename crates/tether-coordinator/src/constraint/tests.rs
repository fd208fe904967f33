use super::*;
use tether_model::tokenizer::{TokenType, Vocab};
use tether_model::{Sampler, SamplingParams};

/// `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then ` ab` and `{"` (a piece across a
/// JSON boundary).
fn byte_tokenizer() -> Tokenizer {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut types = vec![TokenType::Unknown, TokenType::Control, TokenType::Control];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(TokenType::Byte);
    }
    for piece in ["\u{2581}ab", "{\""] {
        tokens.push(piece.to_string());
        types.push(TokenType::Normal);
    }
    let vocab = Vocab {
        model: "llama".into(),
        scores: vec![0.0; tokens.len()],
        tokens,
        token_types: types,
        bos: Some(1),
        eos: Some(2),
        ..Vocab::default()
    };
    Tokenizer::from_vocab(vocab).expect("a valid vocabulary")
}

const EOS: u32 = 2;

fn byte(b: u8) -> u32 {
    3 + u32::from(b)
}

#[test]
fn pieces_are_bytes_and_control_tokens_are_special() {
    let t = byte_tokenizer();
    let env = vocab::token_env(&t).expect("indexed");
    let trie = env.tok_trie();
    assert_eq!(trie.vocab_size(), t.vocab_size());
    assert_eq!(trie.token(byte(b'{')), b"{", "a byte token is its byte");
    assert_eq!(trie.token(259), b" ab", "the word-start marker is a space");
    assert!(trie.is_special_token(EOS), "</s> is special");
    assert_eq!(trie.eos_token(), EOS);
    assert_eq!(
        env.tokenize_bytes(b"{ ab"),
        vec![byte(b'{'), 259],
        "greedy over the pieces"
    );
}

/// Walks `spec` drawing uniformly (seeded) among the allowed tokens until the grammar is
/// complete or allows ending; returns the text.
fn random_walk(grammars: &Grammars, spec: &GrammarSpec, seed: u64, t: &Tokenizer) -> String {
    let mut c = grammars.compile(spec).expect("compiles");
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        seed,
        ..SamplingParams::default()
    };
    let mut sampler = Sampler::new(params);
    let ends = |id: u32| id == EOS;
    let mut out = Vec::new();
    // Flat logits, but ending is likelier than any one token, so walks finish.
    let mut logits = vec![0.0f32; t.vocab_size()];
    logits[EOS as usize] = 4.0;
    for _ in 0..400 {
        let token = c
            .pick_full(&mut sampler, &logits, &out, &ends)
            .expect("matcher")
            .expect("some token is allowed");
        if ends(token) {
            return t.decode(&out);
        }
        assert!(
            c.allowed().expect("matcher").has(token, false),
            "drawn token {token} is allowed"
        );
        out.push(token);
        if c.advance(token).expect("advances") {
            return t.decode(&out);
        }
    }
    panic!("the walk did not finish: {}", t.decode(&out));
}

#[test]
fn every_walk_of_a_schema_parses_and_keeps_its_shape() {
    let t = byte_tokenizer();
    let grammars = Grammars::for_tokenizer(&t).expect("grammars");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "kind": {"enum": ["a", "b\"c"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        },
        "required": ["kind", "n", "tags"],
        "additionalProperties": false,
    });
    let spec = GrammarSpec::JsonSchema(schema);
    for seed in 0..40 {
        let text = random_walk(&grammars, &spec, seed, &t);
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(matches!(v["kind"].as_str(), Some("a" | "b\"c")), "{text}");
        assert!(v["n"].as_u64().is_some_and(|n| n <= 99), "{text}");
        let tags = v["tags"].as_array().expect("tags");
        assert!(tags.len() <= 2, "{text}");
        assert!(
            tags.iter()
                .all(|s| s.as_str().is_some_and(|s| s.chars().count() <= 3)),
            "{text}"
        );
        assert!(
            text.starts_with("{\"kind\": "),
            "one space after separators: {text}"
        );
    }
}

#[test]
fn a_lark_grammar_bounds_the_text() {
    let t = byte_tokenizer();
    let grammars = Grammars::for_tokenizer(&t).expect("grammars");
    let spec = GrammarSpec::Lark(r#"start: ("yes" | "no") " " /[0-9]{1,3}/"#.into());
    for seed in 0..20 {
        let text = random_walk(&grammars, &spec, seed, &t);
        let (word, number) = text.split_once(' ').expect("two parts");
        assert!(matches!(word, "yes" | "no"), "{text}");
        assert!(
            (1..=3).contains(&number.len()) && number.bytes().all(|b| b.is_ascii_digit()),
            "{text}"
        );
    }
}

#[test]
fn end_tokens_are_allowed_only_where_the_grammar_may_end() {
    let t = byte_tokenizer();
    let grammars = Grammars::for_tokenizer(&t).expect("grammars");
    let mut c = grammars
        .compile(&GrammarSpec::Lark(r#"start: "a" "b"?"#.into()))
        .expect("compiles");
    assert!(!c.allowed().expect("mask").has(EOS, true), "nothing yet");
    assert!(c.allowed().expect("mask").has(byte(b'a'), false));
    assert!(!c.allowed().expect("mask").has(byte(b'b'), false));
    assert!(!c.advance(byte(b'a')).expect("advances"), "b may follow");
    assert!(c.allowed().expect("mask").has(EOS, true), "may end after a");
    assert!(
        c.advance(byte(b'b')).expect("advances"),
        "complete after ab"
    );
}

#[test]
fn bad_grammars_and_unsupported_keywords_are_refused_with_their_reason() {
    let t = byte_tokenizer();
    let grammars = Grammars::for_tokenizer(&t).expect("grammars");
    let unsupported = GrammarSpec::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "patternProperties": {"^x": {"type": "string"}},
        "unevaluatedProperties": false,
        "dependentSchemas": {"a": {}},
    }));
    let e = grammars.compile(&unsupported).expect_err("refused");
    assert!(matches!(e, ConstraintError::Grammar(_)), "{e:?}");
    assert!(e.to_string().contains("dependentSchemas"), "{e}");
    let e = grammars
        .compile(&GrammarSpec::Lark("start: undefined_rule".into()))
        .expect_err("refused");
    assert!(e.to_string().contains("undefined_rule"), "{e}");
}

#[test]
fn a_draw_among_top_candidates_needs_every_logit_when_none_is_allowed() {
    let t = byte_tokenizer();
    let grammars = Grammars::for_tokenizer(&t).expect("grammars");
    let mut c = grammars
        .compile(&GrammarSpec::Lark(r#"start: "a""#.into()))
        .expect("compiles");
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let ends = |id: u32| id == EOS;
    let disallowed = [(byte(b'b'), 9.0), (EOS, 8.0), (byte(b'c'), 7.0)];
    assert_eq!(
        c.pick_top(&mut sampler, &disallowed, &[], &ends)
            .expect("matcher"),
        Picked::NeedLogits,
        "neither b, c nor the end is allowed before a"
    );
    let mixed = [(byte(b'b'), 9.0), (byte(b'a'), 1.0)];
    assert_eq!(
        c.pick_top(&mut sampler, &mixed, &[], &ends)
            .expect("matcher"),
        Picked::Token(byte(b'a')),
        "the best allowed candidate, not the best one"
    );
    // Every logit: the allowed token wins even when it is the least likely.
    let mut logits = vec![5.0f32; t.vocab_size()];
    logits[byte(b'a') as usize] = -50.0;
    assert_eq!(
        c.pick_full(&mut sampler, &logits, &[], &ends)
            .expect("matcher"),
        Some(byte(b'a'))
    );
}

#[test]
fn a_token_the_grammar_forces_is_known_without_logits() {
    let t = byte_tokenizer();
    let grammars = Grammars::for_tokenizer(&t).expect("grammars");
    let ends = |id: u32| id == EOS;
    let mut c = grammars
        .compile(&GrammarSpec::Lark(r#"start: "ab" | "ac""#.into()))
        .expect("compiles");
    assert_eq!(c.forced(&ends).expect("matcher"), Some(byte(b'a')));
    c.advance(byte(b'a')).expect("advances");
    assert_eq!(c.forced(&ends).expect("matcher"), None, "b or c");
    assert!(c.advance(byte(b'b')).expect("advances"), "complete");
    // A forced token that would end the generation is not taken.
    let mut c = grammars
        .compile(&GrammarSpec::Lark(r#"start: "a""#.into()))
        .expect("compiles");
    assert_eq!(c.forced(&|id| id == byte(b'a')).expect("matcher"), None);
}
