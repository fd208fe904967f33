//! Replacing the served model at a step boundary. The front loads the new model as sessions
//! of its own beside the old ones, bumps the model epoch (new requests carry it), and hands
//! the scheduler a [`Replace`]. The scheduler keeps serving the old model until every
//! request admitted for it has finished (or the grace has passed: those left get a clear
//! error), closes the old sessions — their memory is freed then — and serves the new model,
//! starting with the requests that waited for it. A `Replace` without a next model unloads.

use super::{Admitted, Scheduler};
use crate::api::{GenError, Health};
use crate::load::LoadedModel;
use crate::model_file::ModelFile;
use crate::placement::Plan;
use std::cmp::Ordering as Order;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::oneshot;

/// A model committed on the workers, ready to be served next.
pub(crate) struct NextModel {
    /// Its file.
    pub model: Arc<ModelFile>,
    /// Its sessions.
    pub loaded: LoadedModel,
    /// Its placement.
    pub plan: Plan,
    /// The epoch requests for it carry.
    pub epoch: u64,
}

/// What the front asks of the scheduler.
pub(crate) struct Replace {
    /// The model to serve once the old one is retired; `None` unloads.
    pub next: Option<NextModel>,
    /// Why nothing serves afterwards (health text), when `next` is `None`.
    pub why: String,
    /// Answered once the old model's sessions are closed and `next` serves.
    pub done: oneshot::Sender<()>,
}

/// A replacement under way: the old model finishes its requests until `deadline`.
pub(super) struct Retiring {
    pub replace: Replace,
    pub deadline: Instant,
}

impl Scheduler {
    /// Takes a request off the queue: starts it when it is for the model served and every
    /// choice has a slot, keeps it aside when it is for the next one or waits for slots
    /// (admission stops until then, so the queue stays bounded and keeps its order),
    /// refuses it when it was for a model replaced since.
    pub(super) fn take_in(&mut self, a: Admitted) {
        match a.epoch.cmp(&self.epoch) {
            Order::Equal if self.fits(&a) => self.start_choices(a),
            Order::Equal | Order::Greater => self.held = Some(a),
            Order::Less => a.refuse(&GenError::Unavailable(
                "the model this request was made for was replaced before it started; \
                 send it again"
                    .into(),
            )),
        }
    }

    /// Starts retiring the served model.
    pub(super) fn begin_retire(&mut self, replace: Replace) {
        self.retiring = Some(Retiring {
            replace,
            deadline: Instant::now() + self.grace,
        });
    }

    /// Whether the model being retired is done with: no request admitted for it runs, or
    /// the grace has passed and those left were ended with an error. Call after `admit`,
    /// which leaves the queue empty of its requests whenever a slot is free.
    pub(super) fn retired(&mut self) -> bool {
        let Some(retiring) = &self.retiring else {
            return false;
        };
        if self.active() == 0 {
            return true;
        }
        if Instant::now() < retiring.deadline {
            return false;
        }
        let error = GenError::Unavailable(format!(
            "the model was replaced or unloaded while this request ran, and it did not \
             finish within the {} s grace; send it again",
            self.grace.as_secs_f64()
        ));
        self.fail_all(&error);
        while self.held.is_none() {
            match self.requests.try_recv() {
                Ok(a) if a.epoch > self.epoch => self.held = Some(a),
                Ok(a) => a.refuse(&error),
                Err(_) => break,
            }
        }
        true
    }

    /// Applies a replacement whose old model is closed: serves the next model, or nothing.
    /// Returns the model to serve.
    pub(super) fn switch(&mut self, replace: Replace) -> Option<LoadedModel> {
        let Replace { next, why, done } = replace;
        let loaded = match next {
            Some(next) => {
                self.model = next.model;
                self.epoch = next.epoch;
                *self.shared.plan.lock().unwrap_or_else(|e| e.into_inner()) = Some(next.plan);
                self.shared.set_health(Health::Ready);
                Some(next.loaded)
            }
            None => {
                *self.shared.plan.lock().unwrap_or_else(|e| e.into_inner()) = None;
                self.shared.set_health(Health::Unavailable(why));
                None
            }
        };
        let _ = done.send(());
        loaded
    }

    /// With no model loaded: refuses requests until a replacement brings one. `None` when
    /// the coordinator stops.
    pub(super) async fn idle(&mut self) -> Option<Replace> {
        let stop = self.stop.clone();
        loop {
            tokio::select! {
                () = stop.cancelled() => return None,
                control = self.control.recv() => match control {
                    Some(r) if r.next.is_some() => return Some(r),
                    // Unloading what is not loaded: nothing to wait for.
                    Some(r) => {
                        self.switch(r);
                    }
                    None => return None,
                },
                next = self.requests.recv(), if self.held.is_none() => match next {
                    Some(a) if a.epoch > self.epoch => self.held = Some(a),
                    Some(a) => a.refuse(&GenError::Unavailable(self.shared.health_text())),
                    None => return None,
                },
            }
        }
    }
}
