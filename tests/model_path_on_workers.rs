//! `--model-path-on-workers` with real `tether worker` and `tether serve` processes: workers
//! whose `--model-dir` holds the model read their layers themselves (their metrics count
//! bytes read locally and none from the network) and generate what a streamed load
//! generates; a copy with one flipped byte, a path outside `--model-dir` (given outright or
//! through a symlink) and a worker without `--model-dir` are refused, named in a warning
//! with the reason, and streamed instead, with the same text.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;
use support::{
    Serve, TinyModel, Worker, completion_body, http, metrics_addr, reference, sample, scrape,
    sessions_and_bytes,
};

const PROMPT: [u32; 5] = [1, 17, 42, 99, 7];
const N_TOKENS: usize = 12;
const LOCAL_BYTES: &str = "tether_tensor_bytes_total{source=\"local_file\"}";
const NETWORK_BYTES: &str = "tether_tensor_bytes_total{source=\"network\"}";
const REFUSED: &str = "tether_local_model_refused_total";

/// A worker with its metrics endpoint and, when given, `--model-dir DIR`.
fn worker(model_dir: Option<&Path>) -> Worker {
    let mut args = vec!["--metrics-listen", "127.0.0.1:0"];
    if let Some(dir) = model_dir {
        args.extend(["--model-dir", dir.to_str().expect("utf-8 temp path")]);
    }
    Worker::start(&args)
}

/// `serve` over `workers`, with `--model-path-on-workers PATH` when given.
fn serve(model: &TinyModel, workers: [&Worker; 2], path_on_workers: Option<&str>) -> Serve {
    let mut args = vec![
        "--model",
        model.arg(),
        "--lease-ttl",
        "2s",
        "--threads",
        "1",
    ];
    for w in workers {
        args.extend(["--worker", w.addr.as_str()]);
    }
    if let Some(path) = path_on_workers {
        args.extend(["--model-path-on-workers", path]);
    }
    Serve::start(&args)
}

/// The greedy completion of `PROMPT`.
fn complete(serve: &Serve) -> String {
    let (status, body) = http(
        &serve.addr,
        "POST",
        "/v1/completions",
        Some(&completion_body(&PROMPT, N_TOKENS, false)),
    );
    assert_eq!(status, 200, "{body}\nserve log:\n{}", serve.log());
    let reply: serde_json::Value = serde_json::from_str(&body).expect("JSON completion");
    reply["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {reply}"))
        .to_string()
}

/// One of the worker's series.
fn series(worker: &Worker, name: &str) -> f64 {
    let text = scrape(&metrics_addr(worker));
    sample(&text, name).unwrap_or_else(|| panic!("no series {name} in:\n{text}"))
}

/// Closes `serve` and waits until the workers hold nothing.
fn close(serve: Serve, workers: [&Worker; 2]) {
    drop(serve);
    for w in workers {
        let freed = w.wait_status(Duration::from_secs(10), |s| sessions_and_bytes(s) == (0, 0));
        assert!(freed.is_some(), "worker {} kept a session", w.addr);
    }
}

/// The coordinator's warning about `worker` not reading its own copy.
fn refusal_warning(serve: &Serve, worker: &Worker) -> String {
    let log = serve.log();
    log.lines()
        .find(|l| {
            l.contains("WARN")
                && l.contains(&format!("worker {} did not read the model", worker.addr))
        })
        .unwrap_or_else(|| panic!("no warning about worker {}; log:\n{log}", worker.addr))
        .to_string()
}

/// A directory `name` beside the model holding a copy of it as `tiny.gguf`, changed by
/// `edit`.
fn model_dir(model: &TinyModel, name: &str, edit: impl FnOnce(&mut Vec<u8>)) -> PathBuf {
    let dir = model.dir.join(name);
    std::fs::create_dir_all(&dir).expect("model dir");
    let mut bytes = std::fs::read(&model.path).expect("read model");
    edit(&mut bytes);
    std::fs::write(dir.join("tiny.gguf"), bytes).expect("write copy");
    dir
}

#[test]
fn workers_with_the_file_read_it_themselves_and_generate_what_streaming_generates() {
    let model = TinyModel::new();
    let dir = model_dir(&model, "models", |_| {});
    let (a, b) = (worker(Some(&dir)), worker(Some(&dir)));
    let (_, ref_text) = reference(&model, &PROMPT, N_TOKENS);

    let streamed = serve(&model, [&a, &b], None);
    let streamed_text = complete(&streamed);
    close(streamed, [&a, &b]);
    assert_eq!(streamed_text, ref_text);
    let network: Vec<f64> = [&a, &b].map(|w| series(w, NETWORK_BYTES)).to_vec();
    assert!(network.iter().all(|&n| n > 0.0), "{network:?}");

    let local = serve(&model, [&a, &b], Some("tiny.gguf"));
    assert_eq!(complete(&local), streamed_text);
    let log = local.log();
    for w in [&a, &b] {
        assert!(
            log.contains(&format!(
                "worker {} read its tensors from its own copy of the model",
                w.addr
            )),
            "{log}"
        );
        assert_eq!(series(w, REFUSED), 0.0);
        assert!(
            w.log()
                .contains("tensors read from the worker's own copy of the model"),
            "{}",
            w.log()
        );
    }
    assert!(!log.contains("streaming its tensors instead"), "{log}");
    // Not one more byte came over the network; the whole model was read from the files.
    assert_eq!([&a, &b].map(|w| series(w, NETWORK_BYTES)).to_vec(), network);
    let read_locally: f64 = [&a, &b].map(|w| series(w, LOCAL_BYTES)).iter().sum();
    assert_eq!(read_locally, network.iter().sum::<f64>());
}

#[test]
fn a_copy_with_one_flipped_byte_is_refused_and_that_worker_gets_the_bytes_streamed() {
    let model = TinyModel::new();
    let flipped = "blk.1.ffn_down.weight";
    let file = tether_gguf::GgufFile::open(&model.path).expect("open model");
    let at = file.tensor(flipped).map(|t| t.offset + t.bytes / 2);
    let at = at.expect("tensor in the tiny model") as usize;
    let dir = model_dir(&model, "models", |bytes| bytes[at] ^= 0x10);
    let (a, b) = (worker(Some(&dir)), worker(Some(&dir)));
    let (_, ref_text) = reference(&model, &PROMPT, N_TOKENS);

    let serve = serve(&model, [&a, &b], Some("tiny.gguf"));
    assert_eq!(complete(&serve), ref_text);
    // The worker whose block holds the flipped tensor refused; the other read its copy.
    let refused: Vec<&Worker> = [&a, &b]
        .into_iter()
        .filter(|w| series(w, REFUSED) == 1.0)
        .collect();
    assert_eq!(refused.len(), 1, "serve log:\n{}", serve.log());
    let (bad, good) = if refused[0].addr == a.addr {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let warning = refusal_warning(&serve, bad);
    assert!(warning.contains("checksum check failed"), "{warning}");
    assert!(warning.contains(flipped), "{warning}");
    assert!(series(bad, NETWORK_BYTES) > 0.0);
    assert_eq!(series(good, REFUSED), 0.0);
    assert_eq!(series(good, NETWORK_BYTES), 0.0);
    assert!(series(good, LOCAL_BYTES) > 0.0);
    assert!(
        serve.log().contains(&format!(
            "streamed the tensors of worker {}'s block",
            bad.addr
        )),
        "{}",
        serve.log()
    );
}

#[cfg(unix)]
#[test]
fn paths_outside_the_model_dir_and_workers_without_one_are_refused_and_streamed() {
    let model = TinyModel::new();
    // The worker's directory holds only a symlink to the coordinator's file beside it.
    let escape = model.dir.join("escape");
    std::fs::create_dir_all(&escape).expect("dir");
    std::os::unix::fs::symlink(&model.path, escape.join("tiny.gguf")).expect("symlink");
    let (a, b) = (worker(Some(&escape)), worker(None));
    let (_, ref_text) = reference(&model, &PROMPT, N_TOKENS);

    let through_link = serve(&model, [&a, &b], Some("tiny.gguf"));
    assert_eq!(complete(&through_link), ref_text);
    let warning = refusal_warning(&through_link, &a);
    assert!(warning.contains("outside"), "{warning}");
    let warning = refusal_warning(&through_link, &b);
    assert!(warning.contains("without --model-dir"), "{warning}");
    close(through_link, [&a, &b]);

    // The same file named by its own absolute path: still outside --model-dir.
    let outright = serve(&model, [&a, &b], Some(model.arg()));
    assert_eq!(complete(&outright), ref_text);
    let warning = refusal_warning(&outright, &a);
    assert!(warning.contains("outside"), "{warning}");
    for (w, refusals) in [(&a, 2.0), (&b, 2.0)] {
        assert_eq!(series(w, REFUSED), refusals, "{}", w.log());
        assert_eq!(series(w, LOCAL_BYTES), 0.0);
        assert!(series(w, NETWORK_BYTES) > 0.0);
    }
}
