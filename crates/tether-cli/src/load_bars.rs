//! Progress bars, one per worker, while a model's tensors stream to the workers (a worker
//! that read its own copy of the model shows full at once, marked so).

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::sync::Arc;
use std::time::Duration;
use tether_coordinator::LoadProgress;
use tokio::sync::oneshot;

/// Bars drawn on stderr (hidden when it is not a terminal) until [`LoadBars::finish`].
pub struct LoadBars {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl LoadBars {
    /// Starts drawing `progress`.
    pub fn start(progress: Arc<LoadProgress>) -> LoadBars {
        let (stop, mut stopped) = oneshot::channel();
        let task = tokio::spawn(async move {
            let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr());
            let style = ProgressStyle::with_template(
                "{prefix:<24} [{bar:30}] {decimal_bytes}/{decimal_total_bytes} {decimal_bytes_per_sec} {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
            let mut bars: Vec<ProgressBar> = Vec::new();
            loop {
                let done = tokio::select! {
                    _ = &mut stopped => true,
                    () = tokio::time::sleep(Duration::from_millis(100)) => false,
                };
                for (i, w) in progress.snapshot().into_iter().enumerate() {
                    if bars.len() <= i {
                        let bar = multi.add(ProgressBar::new(w.total));
                        bar.set_style(style.clone());
                        bar.set_prefix(w.addr.clone());
                        bars.push(bar);
                    }
                    if w.read_by_worker {
                        bars[i].set_prefix(format!("{} (own file)", w.addr));
                    }
                    bars[i].set_length(w.total);
                    bars[i].set_position(w.sent);
                }
                if done {
                    bars.iter().for_each(ProgressBar::finish);
                    if let Some(r) = progress.report() {
                        let _ = multi.println(format!(
                            "loaded {:.2} GB on {} worker(s) in {:.2} s ({:.2} GB/s)",
                            r.tensor_bytes() as f64 / 1e9,
                            r.workers.len(),
                            r.total.as_secs_f64(),
                            r.gb_per_s()
                        ));
                    }
                    return;
                }
            }
        });
        LoadBars { stop, task }
    }

    /// Draws the last state and stops.
    pub async fn finish(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}
