//! `--timings`: where a command's time went from process start, as a table on stderr.

use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tether_coordinator::LoadReport;

static PROCESS_START: OnceLock<Instant> = OnceLock::new();

/// Records the process's start; `main` calls it first so every later mark is measured from
/// there (the few milliseconds of exec and dynamic loading before `main` are not counted).
pub fn mark_process_start() {
    PROCESS_START.get_or_init(Instant::now);
}

/// When the process started (or first asked, when `main` did not mark it).
pub fn process_start() -> Instant {
    *PROCESS_START.get_or_init(Instant::now)
}

/// One row: what, when it began (from process start; `None` for a part of the row above),
/// how long it took, and how deep it is indented.
struct Row {
    what: String,
    start: Option<Duration>,
    took: Duration,
    depth: usize,
}

/// The rows of a command's timeline, printed in the order added.
pub struct Timeline {
    origin: Instant,
    rows: Vec<Row>,
}

impl Default for Timeline {
    fn default() -> Self {
        Self::new()
    }
}

impl Timeline {
    /// A timeline measured from process start.
    pub fn new() -> Self {
        Self {
            origin: process_start(),
            rows: Vec::new(),
        }
    }

    /// A phase that began at `since` and ends now; returns now, for the next phase.
    pub fn phase(&mut self, what: impl Into<String>, since: Instant) -> Instant {
        let now = Instant::now();
        self.rows.push(Row {
            what: what.into(),
            start: Some(since.saturating_duration_since(self.origin)),
            took: now.saturating_duration_since(since),
            depth: 0,
        });
        now
    }

    /// A part of the phase above, measured elsewhere.
    pub fn part(&mut self, depth: usize, what: impl Into<String>, took: Duration) {
        self.rows.push(Row {
            what: what.into(),
            start: None,
            took,
            depth,
        });
    }

    /// The parts of a load (`report`) that took `took` in all, starting at `since`.
    pub fn load(&mut self, report: &LoadReport, since: Instant, took: Duration) {
        self.rows.push(Row {
            what: format!(
                "load: {:.2} GB on {} worker(s), {:.2} GB/s",
                report.tensor_bytes() as f64 / 1e9,
                report.workers.len(),
                tether_protocol::prepare_timings::gb_per_s(report.tensor_bytes(), took)
            ),
            start: Some(since.saturating_duration_since(self.origin)),
            took,
            depth: 0,
        });
        self.part(
            1,
            "connect to the workers, place the layers",
            took.saturating_sub(report.total),
        );
        self.part(1, "open a session on every worker", report.attach);
        self.part(1, "prepare on every worker (at once)", report.prepare);
        for w in &report.workers {
            let t = &w.prepared.worker;
            self.part(
                2,
                format!(
                    "worker {}: {:.2} GB {}, {:.2} GB/s",
                    w.addr,
                    w.tensor_bytes as f64 / 1e9,
                    w.via,
                    w.gb_per_s()
                ),
                w.prepared.wall,
            );
            if let Some(lost) = w.refused_local {
                self.part(3, "its own copy refused (before streaming)", lost);
            }
            self.part(3, "coordinator: CRC-32 of the tensors", w.prepared.digests);
            self.part(3, "worker: parse the header, plan", t.plan);
            self.part(3, "worker: admit and allocate", t.allocate);
            self.part(3, "worker: wait for bytes (network or file)", t.read);
            self.part(3, "worker: CRC-32 check", t.checksum);
            self.part(3, "worker: copy to the device", t.upload);
            self.part(3, "worker: verify, repack weights, sync", t.finish);
        }
        self.part(1, "commit on every worker", report.commit);
        self.part(1, "open the data links", report.links);
    }

    /// Prints the table on stderr.
    pub fn print(&self) {
        eprintln!("{}", self.render());
    }

    fn render(&self) -> String {
        let mut out = String::from("timings (seconds from process start)\n");
        out.push_str(&format!("{:>8} {:>8}  what\n", "start", "took"));
        for row in &self.rows {
            let start = row
                .start
                .map_or(String::new(), |s| format!("{:.3}", s.as_secs_f64()));
            out.push_str(&format!(
                "{start:>8} {:>8.3}  {}{}\n",
                row.took.as_secs_f64(),
                "  ".repeat(row.depth),
                row.what
            ));
        }
        out.pop();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_print_in_order_with_their_start_and_depth() {
        let mut t = Timeline::new();
        let since = t.origin;
        t.phase("first", since);
        t.part(2, "a part", Duration::from_millis(1500));
        let text = t.render();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[2].trim_start().starts_with("0.000"), "{text}");
        assert!(lines[2].ends_with("  first"), "{text}");
        assert!(lines[3].contains("1.500      a part"), "{text}");
    }
}
