//! `--device` on a machine without a CUDA GPU (CI): `auto` (the default) runs on the cpu,
//! and naming a GPU exits non-zero with a message, never a panic; `bench --pipeline` on the
//! cpu gives a row per worker count (one sequence, or several at once with `--parallel`),
//! and `bench --parallel` a row per count of sequences.

mod support;

use std::process::Command;
use support::{TETHER, TinyModel};

fn tether(args: &[&str]) -> (bool, String) {
    let out = Command::new(TETHER)
        .args(args)
        .output()
        .expect("run tether");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    (out.status.success(), text)
}

#[test]
fn without_a_gpu_auto_uses_the_cpu_and_cuda_is_a_clear_error() {
    if tether_compute::cuda::device_count() > 0 {
        // On a GPU machine `auto` picks the GPU; the GPU scripts cover that path.
        return;
    }
    let model = TinyModel::new();
    let run = ["run", "--model", model.arg(), "--prompt", "hi", "-n", "3"];
    let (ok, text) = tether(&run);
    assert!(ok, "run with the default device failed:\n{text}");

    for device in ["cuda", "cuda:0", "cuda:3"] {
        let mut args = run.to_vec();
        args.extend(["--device", device]);
        let (ok, text) = tether(&args);
        assert!(
            !ok,
            "run --device {device} succeeded without a GPU:\n{text}"
        );
        assert!(
            !text.contains("panicked"),
            "run --device {device} panicked:\n{text}"
        );
        assert!(
            text.contains("CUDA") || text.contains("libcuda"),
            "run --device {device}: no word of CUDA in:\n{text}"
        );
    }
    let bench = [
        "bench",
        "--model",
        model.arg(),
        "-p",
        "4",
        "-n",
        "2",
        "-r",
        "1",
    ];
    let (ok, text) = tether(&[&bench[..], &["--device", "cuda:0"]].concat());
    assert!(
        !ok && !text.contains("panicked"),
        "bench --device cuda:0:\n{text}"
    );
    let (ok, text) = tether(&[&bench[..], &["--device", "gpu"]].concat());
    assert!(
        !ok && text.contains("unknown device"),
        "bench --device gpu:\n{text}"
    );
}

/// The cells of the `| tgN | workers | ...` row of a `bench --pipeline` table.
fn tg_row(text: &str, workers: &str) -> Vec<String> {
    let row = text
        .lines()
        .find(|l| l.starts_with("| tg4 |") && l.split('|').nth(2).map(str::trim) == Some(workers))
        .unwrap_or_else(|| panic!("no tg4 row for {workers} worker(s) in:\n{text}"));
    row.split('|').map(|c| c.trim().to_string()).collect()
}

#[test]
fn bench_pipeline_gives_every_worker_count_a_row_against_the_first() {
    if tether_compute::cuda::device_count() > 0 {
        // On a GPU machine `auto` picks the GPU; the GPU scripts run this bench there.
        return;
    }
    let model = TinyModel::new();
    let bench = [
        "bench",
        "--model",
        model.arg(),
        "--pipeline",
        "1,2",
        "-p",
        "4",
        "-n",
        "4",
        "-r",
        "2",
    ];
    // One sequence; then three at once over two lanes with prompts in chunks of 2.
    let many = [
        "--parallel",
        "3",
        "--pipeline-lanes",
        "2",
        "--prefill-chunk",
        "2",
    ];
    for extra in [&[][..], &many[..]] {
        let (ok, text) = tether(&[&bench[..], extra].concat());
        assert!(ok, "bench --pipeline 1,2 {extra:?} failed:\n{text}");
        let number = |cell: &str| -> f64 {
            cell.parse()
                .unwrap_or_else(|_| panic!("{cell:?} is not a number in:\n{text}"))
        };
        let one = tg_row(&text, "1");
        let two = tg_row(&text, "2");
        // Cells: "", test, workers, t/s, ±, ratio, ms in blocks, ms between, "".
        assert_eq!(one[5], "1.000", "the first count is the reference:\n{text}");
        for row in [&one, &two] {
            let (rate, ratio, inside) = (number(&row[3]), number(&row[5]), number(&row[6]));
            assert!(rate > 0.0 && rate.is_finite(), "{row:?}");
            assert!(ratio > 0.0 && ratio.is_finite(), "{row:?}");
            assert!(inside > 0.0 && inside.is_finite(), "{row:?}");
        }
        let ratio = number(&two[5]);
        let expected = number(&two[3]) / number(&one[3]);
        assert!(
            (ratio - expected).abs() < 2e-3,
            "the ratio {ratio} is not the rates' {expected}:\n{text}"
        );
    }
}

#[test]
fn bench_parallel_gives_every_count_of_sequences_a_row() {
    if tether_compute::cuda::device_count() > 0 {
        // On a GPU machine `auto` picks the GPU; the GPU scripts run this bench there.
        return;
    }
    let model = TinyModel::new();
    let bench = [
        "bench",
        "--model",
        model.arg(),
        "-p",
        "4",
        "-n",
        "3",
        "-r",
        "1",
    ];
    // 12 sequences decode in steps larger than a replayed step (8 tokens).
    let (ok, text) = tether(&[&bench[..], &["--parallel", "1,3,12"]].concat());
    assert!(ok, "bench --parallel 1,3,12 failed:\n{text}");
    let number = |cell: &str| -> f64 {
        cell.parse()
            .unwrap_or_else(|_| panic!("{cell:?} is not a number in:\n{text}"))
    };
    for n in ["1", "3", "12"] {
        let row: Vec<&str> = text
            .lines()
            .find(|l| l.split('|').nth(1).map(str::trim) == Some(n))
            .unwrap_or_else(|| panic!("no row for {n} sequences in:\n{text}"))
            .split('|')
            .map(str::trim)
            .collect();
        // Cells: "", sequences, pp t/s, tg t/s, ±, t/s a sequence, "".
        let (pp, tg, each) = (number(row[2]), number(row[3]), number(row[5]));
        assert!(pp > 0.0 && pp.is_finite(), "{row:?}");
        assert!(tg > 0.0 && tg.is_finite(), "{row:?}");
        let expected = tg / number(n);
        assert!(
            (each - expected).abs() <= 0.01 * expected.max(1.0),
            "{row:?}"
        );
    }
    for (bad, says) in [
        (&["--parallel", "0,2"][..], "at least 1"),
        (
            &["--parallel", "8", "--ubatch", "4"][..],
            "smaller than 8 sequences",
        ),
        (
            &["--parallel", "2,4", "--pipeline", "1"][..],
            "one count of sequences",
        ),
        (&["--pipeline-lanes", "2"][..], "--pipeline"),
    ] {
        let (ok, text) = tether(&[&bench[..], bad].concat());
        assert!(!ok && text.contains(says), "bench {bad:?}:\n{text}");
        assert!(!text.contains("panicked"), "bench {bad:?}:\n{text}");
    }
}
