use super::*;
use tether_model::SamplingParams;

fn seq(
    slot: u32,
    prompt: usize,
    fed: usize,
) -> (Sequence, mpsc::Receiver<Result<GenEvent, GenError>>) {
    let (tx, rx) = mpsc::channel(16);
    let s = Sequence {
        slot,
        lane: 0,
        tokens: (0..prompt as u32).map(|t| t + 100 * slot).collect(),
        prompt_len: prompt,
        fed,
        generated: 0,
        dropped: 0,
        max_tokens: 3,
        sampler: Sampler::new(SamplingParams::greedy()),
        deadline: None,
        stop_tokens: Vec::new(),
        events: tx,
        logprobs: None,
        prompt_logprobs: None,
        prompt_scores: None,
        scored: None,
        constraint: None,
        needs_logits: false,
        embed: None,
    };
    (s, rx)
}

#[test]
fn decode_tokens_come_first_and_prompts_are_chunked() {
    let (mut a, _ra) = seq(0, 5, 5);
    a.tokens.push(7); // a sampled token waiting to be fed
    let (b, _rb) = seq(1, 10, 0);
    let slots = vec![Some(b), None, Some(a)];
    let batch = build_batch(&slots, 4, 0);
    assert_eq!(batch.tokens[0], TokenPos { seq: 0, pos: 5 });
    assert_eq!(batch.ids[0], 7);
    assert_eq!(batch.tokens.len(), 4, "ubatch caps the batch");
    assert_eq!(batch.ids[1..], [100, 101, 102]);
    assert_eq!(
        batch.logits_rows,
        vec![0],
        "the unfinished prompt asks no logits"
    );
    assert_eq!(batch.sample_for, vec![2]);
    assert_eq!(batch.fed, vec![(2, 1), (0, 3)]);
}

#[test]
fn the_last_prompt_chunk_asks_for_logits() {
    let (b, _rb) = seq(1, 6, 4);
    let batch = build_batch(&[Some(b)], 8, 0);
    assert_eq!(batch.tokens.len(), 2);
    assert_eq!(batch.tokens[1], TokenPos { seq: 1, pos: 5 });
    assert_eq!(batch.logits_rows, vec![1]);
}

#[test]
fn rotation_serves_everyone() {
    let (a, _ra) = seq(0, 3, 0);
    let (b, _rb) = seq(1, 3, 0);
    let slots = vec![Some(a), Some(b)];
    assert_eq!(build_batch(&slots, 3, 0).fed, vec![(0, 3)]);
    assert_eq!(build_batch(&slots, 3, 1).fed, vec![(1, 3)]);
}

#[test]
fn split_keeps_sequences_whole_and_rows_aligned() {
    let (mut a, _ra) = seq(0, 2, 2);
    a.tokens.push(7);
    let (b, _rb) = seq(1, 3, 0);
    let (c, _rc) = seq(2, 4, 2);
    let whole = build_batch(&[Some(a), Some(b), Some(c)], 16, 0);
    let parts = split_batch(whole.clone(), 2);
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].fed, vec![(0, 1), (2, 2)]);
    assert_eq!(parts[1].fed, vec![(1, 3)]);
    assert_eq!(parts[0].ids, vec![7, 202, 203]);
    assert_eq!(parts[0].logits_rows, vec![0, 2]);
    assert_eq!(parts[0].sample_for, vec![0, 2]);
    assert_eq!(parts[1].logits_rows, vec![2]);
    assert_eq!(parts[1].tokens[0], TokenPos { seq: 1, pos: 0 });
    let rows: usize = parts.iter().map(|p| p.logits_rows.len()).sum();
    assert_eq!(rows, whole.logits_rows.len());
    assert_eq!(split_batch(whole.clone(), 1), vec![whole]);
}

#[test]
fn split_off_moves_picked_sequences_to_a_batch_of_their_own() {
    let (mut a, _ra) = seq(0, 2, 1);
    a.fetch_logits();
    let (mut b, _rb) = seq(1, 2, 2);
    b.tokens.push(9);
    let (c, _rc) = seq(2, 3, 0);
    let whole = build_batch(&[Some(a), Some(b), Some(c)], 16, 0);
    let parts = split_off(whole.clone(), |i| i == 0);
    assert_eq!(parts.len(), 2);
    assert_eq!(parts[0].fed, vec![(1, 1), (2, 3)]);
    assert_eq!(parts[0].sample_for, vec![1, 2]);
    assert_eq!(parts[0].logits_rows, vec![0, 3]);
    assert_eq!(parts[1].fed, vec![(0, 2)], "fed again from where it was");
    assert_eq!(parts[1].sample_for, vec![0]);
    assert_eq!(parts[1].logits_rows, vec![1]);
    assert_eq!(split_off(whole.clone(), |_| false), vec![whole.clone()]);
    assert_eq!(split_off(whole.clone(), |_| true), vec![whole]);
}

#[test]
fn accept_follows_the_generator_rules() {
    let (mut s, mut rx) = seq(0, 2, 2);
    assert_eq!(
        s.accept(9, true, 16, None),
        Next::Finish(FinishReason::Stop)
    );
    assert!(
        rx.try_recv().is_err(),
        "an end-of-generation token is not sent"
    );
    assert_eq!(s.accept(5, false, 16, None), Next::Continue);
    assert_eq!(rx.try_recv().unwrap(), Ok(GenEvent::Token(5)));
    assert_eq!(
        s.accept(6, false, 3, None),
        Next::Finish(FinishReason::Length),
        "context full"
    );
    let (mut s, _rx) = seq(0, 2, 2);
    s.accept(1, false, 16, None);
    s.accept(1, false, 16, None);
    assert_eq!(
        s.accept(1, false, 16, None),
        Next::Finish(FinishReason::Length)
    );
    assert_eq!(s.generated, 3);
}

#[test]
fn a_full_context_shifts_and_feeds_the_kept_tail_again() {
    // Prompt of 6 in a context of 8; keep 2.
    let (mut s, _rx) = seq(0, 6, 6);
    s.max_tokens = 100;
    let shift = Some(ContextShift { keep: 2 });
    assert_eq!(s.accept(50, false, 8, shift), Next::Continue);
    s.fed += 1;
    assert_eq!(s.accept(51, false, 8, shift), Next::Continue);
    s.fed += 1;
    // 9 tokens, 8 fed: full. Of the 6 after the kept 2, the oldest 3 go.
    assert_eq!(s.accept(52, false, 8, shift), Next::Shifted(2));
    assert_eq!(s.tokens, vec![0, 1, 5, 50, 51, 52]);
    assert_eq!((s.fed, s.dropped, s.generated), (2, 3, 3));
    assert_eq!(s.prompt_part(4), 0, "fed again, not prompt");
    // The tail goes with the prompt chunks and asks for logits at its end.
    let batch = build_batch(&[Some(s)], 16, 0);
    assert_eq!(batch.ids, vec![5, 50, 51, 52]);
    assert_eq!(batch.tokens[0], TokenPos { seq: 0, pos: 2 });
    assert_eq!(batch.logits_rows, vec![3]);
}

#[test]
fn a_step_chunks_a_long_prompt_for_the_pipeline() {
    let (mut a, _ra) = seq(0, 2, 2);
    a.tokens.push(7);
    let (b, _rb) = seq(1, 10, 1);
    let slots = vec![Some(a), Some(b)];
    let shape = |chunks| StepShape {
        ubatch: 4,
        prompt_chunk: 4,
        chunks,
    };
    let chunks = build_step(&slots, 0, shape(3), 0);
    assert_eq!(chunks.len(), 3);
    assert_eq!(chunks[0].fed, vec![(0, 1), (1, 3)], "decode first");
    assert_eq!(chunks[1].fed, vec![(1, 4)]);
    assert_eq!(chunks[1].tokens[0], TokenPos { seq: 1, pos: 4 });
    assert_eq!(chunks[2].fed, vec![(1, 2)]);
    assert_eq!(chunks[2].tokens[1], TokenPos { seq: 1, pos: 9 });
    assert_eq!(chunks[0].sample_for, vec![0]);
    assert!(chunks[1].logits_rows.is_empty());
    assert_eq!(
        chunks[2].logits_rows,
        vec![1],
        "logits where the prompt ends"
    );
    assert_eq!(
        build_step(&slots, 0, shape(8), 0).len(),
        3,
        "no empty chunks"
    );
    assert_eq!(
        build_step(&slots, 0, shape(1), 0),
        vec![build_batch(&slots, 4, 0)]
    );
    assert!(
        build_step(&slots, 1, shape(3), 0)[0].tokens.is_empty(),
        "lane 1 is empty"
    );
}

#[test]
fn prompt_chunks_are_capped_but_decode_tokens_are_not() {
    let decoding: Vec<_> = (0..3)
        .map(|i| {
            let (mut s, rx) = seq(i, 2, 2);
            s.tokens.push(7);
            (s, rx)
        })
        .collect();
    let (long, _rl) = seq(3, 9, 0);
    let mut slots: Vec<_> = decoding.into_iter().map(|(s, _)| Some(s)).collect();
    slots.push(Some(long));
    let shape = StepShape {
        ubatch: 8,
        prompt_chunk: 2,
        chunks: 8,
    };
    let chunks = build_step(&slots, 0, shape, 0);
    assert_eq!(chunks[0].fed, vec![(0, 1), (1, 1), (2, 1), (3, 2)]);
    let prompt: Vec<usize> = chunks[1..].iter().map(|c| c.tokens.len()).collect();
    assert_eq!(
        prompt,
        vec![2, 2, 2, 1],
        "the rest of the prompt in chunks of 2"
    );
    assert_eq!(chunks[4].logits_rows, vec![0]);
}

#[test]
fn a_step_shape_cuts_prompts_only_over_several_workers() {
    let one = StepShape::new(512, 1, 64);
    assert_eq!((one.prompt_chunk, one.chunks), (512, 1));
    let two = StepShape::new(512, 2, 64);
    assert_eq!((two.prompt_chunk, two.chunks), (64, 8));
    let floor = StepShape::new(512, 2, 128);
    assert_eq!((floor.prompt_chunk, floor.chunks), (128, 8));
    let small = StepShape::new(8, 2, 64);
    assert_eq!(small.prompt_chunk, 8, "never above ubatch");
}

#[test]
fn a_shift_with_nothing_to_drop_ends_with_length() {
    let (mut s, _rx) = seq(0, 3, 3);
    s.max_tokens = 100;
    let keep_all = Some(ContextShift { keep: 3 });
    assert_eq!(
        s.accept(9, false, 3, keep_all),
        Next::Finish(FinishReason::Length)
    );
    let (mut s, _rx) = seq(0, 3, 3);
    s.max_tokens = 1;
    assert_eq!(
        s.accept(9, false, 3, Some(ContextShift { keep: 0 })),
        Next::Finish(FinishReason::Length),
        "max_tokens wins over a shift"
    );
}

#[test]
fn a_scored_prompt_asks_for_every_position_with_the_next_token_as_target() {
    let (mut a, _ra) = seq(0, 2, 2);
    a.tokens.push(7);
    let (mut b, _rb) = seq(1, 5, 0);
    b.prompt_scores = Some(vec![None]);
    let slots = vec![Some(a), Some(b)];
    let first = build_batch(&slots, 4, 0);
    // The decode token of slot 0, then positions 0..3 of slot 1's prompt.
    assert_eq!(first.logits_rows, vec![0, 1, 2, 3]);
    assert_eq!(
        first.uses,
        vec![
            RowUse::Sample(0),
            RowUse::Score(1),
            RowUse::Score(1),
            RowUse::Score(1)
        ]
    );
    assert_eq!(
        first.targets,
        vec![0, 101, 102, 103],
        "the next prompt tokens"
    );
    assert_eq!(first.sample_for, vec![0]);
    let parts = split_batch(first, 2);
    assert_eq!(parts[0].uses, vec![RowUse::Sample(0)]);
    assert!(parts[0].targets.is_empty(), "no scores, no targets");
    assert_eq!(parts[1].logits_rows, vec![0, 1, 2]);
    assert_eq!(parts[1].targets, vec![101, 102, 103]);
    assert!(parts[1].sample_for.is_empty());
    // The last two: position 3 scores token 4, position 4 samples.
    let mut slots = slots;
    if let Some(b) = &mut slots[1] {
        b.fed = 3;
    }
    slots[0] = None;
    let last = build_batch(&slots, 4, 0);
    assert_eq!(last.logits_rows, vec![0, 1]);
    assert_eq!(last.uses, vec![RowUse::Score(1), RowUse::Sample(1)]);
    assert_eq!(last.targets, vec![104, 0]);
    let unscored = build_batch(&[Some(seq(1, 5, 0).0)], 8, 0);
    assert_eq!(unscored.logits_rows, vec![4], "only where the prompt ends");
    assert!(unscored.targets.is_empty());
}
