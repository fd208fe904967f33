//! What the clients of `bench --serve` do: a warm-up request, then every client at once,
//! each sending its requests (or conversations) one after another.

use super::client::{Endpoint, Timing};
use super::prompts::{PromptShape, Rng, completion_prompt, words};
use super::report::{Measured, Outcome, Summary};
use anyhow::Result;
use serde_json::json;
use std::time::Instant;

/// What every client does, checked.
pub(super) struct Workload {
    pub(super) clients: usize,
    pub(super) requests: usize,
    pub(super) turns: Option<usize>,
    pub(super) shape: PromptShape,
    pub(super) n_gen: usize,
    pub(super) seed: u64,
    /// Sent with every request (`--json-schema`).
    pub(super) response_format: Option<serde_json::Value>,
}

/// One warm-up request, then every client at once; the figures of the clients' requests.
pub(super) fn measure(endpoint: &Endpoint, w: &Workload) -> Result<Summary> {
    // Warm-up: kernels compiled, graphs recorded, connections made. Its prompt is its own
    // (no shared prefix), so it does not warm the prefix cache for the measured requests.
    let warm = Workload {
        shape: PromptShape {
            shared: 0,
            ..w.shape
        },
        turns: w.turns.map(|_| 1),
        response_format: w.response_format.clone(),
        ..*w
    };
    one_client(endpoint, &warm, u64::MAX / 2, 1)
        .into_iter()
        .find_map(|o| o.result.err())
        .map_or(Ok(()), |e| {
            Err(anyhow::anyhow!("the warm-up request failed: {e}"))
        })?;
    let barrier = std::sync::Barrier::new(w.clients);
    let started = Instant::now();
    let outcomes = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..w.clients)
            .map(|c| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    one_client(endpoint, w, c as u64, w.requests)
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|_| vec![panicked()]))
            .collect::<Vec<_>>()
    });
    Ok(Summary::of(&Measured {
        outcomes,
        wall: started.elapsed(),
    }))
}

fn panicked() -> Outcome {
    Outcome {
        round: 0,
        result: Err("a client thread panicked".into()),
    }
}

/// Client `client`'s `requests` requests (or conversations), one after another.
fn one_client(endpoint: &Endpoint, w: &Workload, client: u64, requests: usize) -> Vec<Outcome> {
    let mut outcomes = Vec::new();
    for r in 0..requests as u64 {
        let id = client.wrapping_mul(requests as u64).wrapping_add(r);
        match w.turns {
            None => {
                let mut body = json!({
                    "prompt": completion_prompt(w.shape, w.seed, id),
                    "max_tokens": w.n_gen,
                });
                if let Some(format) = &w.response_format {
                    body["response_format"] = format.clone();
                }
                let result = endpoint.stream("/v1/completions", body);
                outcomes.push(Outcome {
                    round: r as usize,
                    result: result.map_err(|e| format!("{e:#}")),
                });
            }
            Some(turns) => outcomes.extend(conversation(endpoint, w, id, turns)),
        }
    }
    outcomes
}

/// One conversation of `turns` turns, each resending the history and a new user message.
/// It stops at the first failed turn: the next would lack the reply.
fn conversation(endpoint: &Endpoint, w: &Workload, id: u64, turns: usize) -> Vec<Outcome> {
    let mut messages = Vec::new();
    if w.shape.shared > 0 {
        let system = words(&mut Rng::new(w.seed, 0), w.shape.shared);
        messages.push(json!({"role": "system", "content": system}));
    }
    let mut outcomes = Vec::new();
    for turn in 0..turns {
        let stream = 1 + id.wrapping_mul(turns as u64).wrapping_add(turn as u64);
        let user = words(&mut Rng::new(w.seed, stream), w.shape.len.max(1));
        messages.push(json!({"role": "user", "content": user}));
        let mut body = json!({"messages": messages, "max_tokens": w.n_gen});
        if let Some(format) = &w.response_format {
            body["response_format"] = format.clone();
        }
        let result: Result<Timing> = endpoint.stream("/v1/chat/completions", body);
        let failed = result.is_err();
        if let Ok(t) = &result {
            messages.push(json!({"role": "assistant", "content": t.text}));
        }
        outcomes.push(Outcome {
            round: turn,
            result: result.map_err(|e| format!("{e:#}")),
        });
        if failed {
            break;
        }
    }
    outcomes
}
