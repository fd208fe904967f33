//! Changing the served model without a restart (`POST`/`DELETE /v1/admin/model`).
//!
//! A load places the new model against the memory the workers report free — the old
//! model's reservations already count there — and loads it by two-phase commit as
//! sessions of its own. Only when every worker committed does the model epoch change: new
//! requests are admitted for the new model, the old one finishes what it admitted, its
//! sessions are closed (their memory freed), and the new model serves. When the new model
//! does not fit beside the old one the load is refused and the old one serves on, unless
//! the caller asked to unload first: then nothing serves until the new model is loaded
//! (and, if that fails, the old one is loaded again). One change runs at a time.

use crate::api::{Health, ModelChange, ModelInfo};
use crate::engine::{Coordinator, CoordinatorError};
use crate::load::LoadedModel;
use crate::model_file::{ModelFile, ModelFileError};
use crate::placement::Plan;
use crate::progress::LoadProgress;
use crate::scheduler::replace::{NextModel, Replace};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::oneshot;

/// A model to load.
#[derive(Clone, Debug)]
pub struct ModelLoad {
    /// The GGUF file, as the coordinator sees it.
    pub path: PathBuf,
    /// Its id in the API; the file stem when `None`.
    pub id: Option<String>,
    /// When the new model does not fit beside the served one, unload the served one first
    /// (requests are refused until the new one serves) instead of refusing the load.
    pub unload_first: bool,
}

/// Why a model change was refused or failed. Whatever served before still serves, unless
/// the message says otherwise (only after `unload_first`).
#[derive(Debug, thiserror::Error)]
pub enum ModelChangeError {
    /// Another load or unload is running.
    #[error("another model load or unload is running; wait until it has finished")]
    Busy,
    /// The file could not be read as a model.
    #[error(transparent)]
    BadFile(#[from] ModelFileError),
    /// The model does not fit the workers' free memory (beside the served model).
    #[error("model {model} does not fit the workers: {detail}; {outcome}")]
    DoesNotFit {
        /// The model asked for.
        model: String,
        /// The placement's answer.
        detail: String,
        /// What serves now, and what to do.
        outcome: String,
    },
    /// Connecting or the two-phase load failed.
    #[error("loading model {model} failed: {detail}; {outcome}")]
    LoadFailed {
        /// The model asked for.
        model: String,
        /// Why.
        detail: String,
        /// What serves now.
        outcome: String,
    },
    /// Unload with no model loaded.
    #[error("no model is loaded; there is nothing to unload")]
    NotLoaded,
    /// The coordinator is shutting down.
    #[error("the coordinator is shutting down")]
    ShuttingDown,
}

/// What a model change did.
#[derive(Clone, Debug)]
pub struct ModelChangeReport {
    /// The model served now (`None` after an unload).
    pub model: Option<String>,
    /// The model served before.
    pub previous: Option<String>,
    /// Whether requests were refused meanwhile (unload, or `unload_first`).
    pub outage: bool,
    /// The new model's placement.
    pub plan: Option<Plan>,
}

/// The change under way, for `/health`.
pub(crate) struct ChangeState {
    model: String,
    phase: &'static str,
    progress: Option<Arc<LoadProgress>>,
}

/// Whether a load failed for lack of memory: no placement fits the free memory the
/// workers reported, or a worker's admission refused its block.
fn does_not_fit(e: &CoordinatorError) -> bool {
    matches!(
        e,
        CoordinatorError::Placement(_)
            | CoordinatorError::Load(crate::load::LoadError::Refused {
                out_of_memory: true,
                ..
            })
    )
}

impl Coordinator {
    /// Loads `load` beside the served model and switches to it, or (with `unload_first`,
    /// when it does not fit beside) unloads the served model first. Runs on a task of its
    /// own, so a caller that goes away does not stop a change half-way.
    pub async fn load_model(
        self: &Arc<Self>,
        load: ModelLoad,
    ) -> Result<ModelChangeReport, ModelChangeError> {
        let this = Arc::clone(self);
        tokio::spawn(async move { this.load_now(load).await })
            .await
            .unwrap_or(Err(ModelChangeError::ShuttingDown))
    }

    /// Finishes the requests admitted for the served model (within the retire grace),
    /// closes its sessions and serves nothing until a load.
    pub async fn unload_model(self: &Arc<Self>) -> Result<ModelChangeReport, ModelChangeError> {
        let this = Arc::clone(self);
        tokio::spawn(async move { this.unload_now().await })
            .await
            .unwrap_or(Err(ModelChangeError::ShuttingDown))
    }

    /// The file of the model served (or last served).
    pub fn model_path(&self) -> PathBuf {
        self.served().file.path().to_path_buf()
    }

    async fn unload_now(&self) -> Result<ModelChangeReport, ModelChangeError> {
        let _one = self
            .changing
            .try_lock()
            .map_err(|_| ModelChangeError::Busy)?;
        let id = {
            let served = self.served();
            if !served.loaded {
                return Err(ModelChangeError::NotLoaded);
            }
            served.info.id.clone()
        };
        self.set_change(&id, "unloading", None);
        let why = format!(
            "no model is loaded: {id} was unloaded through DELETE /v1/admin/model; load one \
             with POST /v1/admin/model"
        );
        let retired = self.retire(why).await;
        self.clear_change();
        retired?;
        Ok(ModelChangeReport {
            model: None,
            previous: Some(id),
            outage: true,
            plan: None,
        })
    }

    async fn load_now(&self, load: ModelLoad) -> Result<ModelChangeReport, ModelChangeError> {
        let _one = self
            .changing
            .try_lock()
            .map_err(|_| ModelChangeError::Busy)?;
        if self.stop.is_cancelled() {
            return Err(ModelChangeError::ShuttingDown);
        }
        let path = load.path.clone();
        let file = tokio::task::spawn_blocking(move || ModelFile::open(path))
            .await
            .map_err(|_| ModelChangeError::ShuttingDown)??;
        let id = load.id.clone().unwrap_or_else(|| {
            file.path()
                .file_stem()
                .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
        });
        let previous = {
            let served = self.served();
            served
                .loaded
                .then(|| (served.info.id.clone(), Arc::clone(&served.file)))
        };
        let result = self.load_then_switch(&load, &file, &id, &previous).await;
        self.clear_change();
        result
    }

    async fn load_then_switch(
        &self,
        load: &ModelLoad,
        file: &Arc<ModelFile>,
        id: &str,
        previous: &Option<(String, Arc<ModelFile>)>,
    ) -> Result<ModelChangeReport, ModelChangeError> {
        let previous_id = previous.as_ref().map(|(p, _)| p.clone());
        let mut outage = false;
        let attempt = match self.load_files(file, id).await {
            Err(e) if does_not_fit(&e) && load.unload_first && previous.is_some() => {
                tracing::info!(
                    "{id} does not fit beside the served model ({e}); unloading it first"
                );
                outage = true;
                let old = previous_id.clone().unwrap_or_default();
                self.set_change(id, "unloading", None);
                self.retire(format!(
                    "model {old} was unloaded to load {id} (unload_first); retry when GET \
                     /health answers 200"
                ))
                .await?;
                self.load_files(file, id).await
            }
            attempt => attempt,
        };
        match attempt {
            Ok((loaded, plan)) => {
                self.set_change(id, "switching", None);
                self.switch_to(file, id, loaded, plan.clone()).await?;
                tracing::info!("model {id} serves now:\n{plan}");
                Ok(ModelChangeReport {
                    model: Some(id.to_string()),
                    previous: previous_id,
                    outage,
                    plan: Some(plan),
                })
            }
            Err(e) => {
                let outcome = match (previous, outage) {
                    (Some((old, old_file)), true) => self.restore(old, old_file).await,
                    (Some((old, _)), false) => {
                        let hint = match does_not_fit(&e) {
                            true => {
                                " (to swap anyway, unload it first: unload_first, a short outage)"
                            }
                            false => "",
                        };
                        format!("{old} keeps serving{hint}")
                    }
                    (None, _) => "no model is loaded".to_string(),
                };
                Err(match e {
                    e if does_not_fit(&e) => ModelChangeError::DoesNotFit {
                        model: id.to_string(),
                        detail: e.to_string(),
                        outcome,
                    },
                    e => ModelChangeError::LoadFailed {
                        model: id.to_string(),
                        detail: e.to_string(),
                        outcome,
                    },
                })
            }
        }
    }

    /// Loads the previous model again after `unload_first` and a failed load.
    async fn restore(&self, old: &str, old_file: &Arc<ModelFile>) -> String {
        match self.load_files(old_file, old).await {
            Ok((loaded, plan)) => match self.switch_to(old_file, old, loaded, plan).await {
                Ok(()) => format!("{old} was loaded again and serves"),
                Err(e) => format!("loading {old} again failed: {e}; no model is loaded"),
            },
            Err(e) => {
                let why = format!("no model is loaded: loading {old} again failed too: {e}");
                self.shared.set_health(Health::Unavailable(why.clone()));
                why
            }
        }
    }

    /// Places and loads `file` over the workers (tensors streamed from this process).
    async fn load_files(
        &self,
        file: &Arc<ModelFile>,
        id: &str,
    ) -> Result<(LoadedModel, Plan), CoordinatorError> {
        let progress = Arc::new(LoadProgress::default());
        self.set_change(id, "loading", Some(Arc::clone(&progress)));
        let mut setup = self.setup.clone();
        setup.load.progress = Some(progress);
        // The path given at start names the first model's file on the workers.
        setup.load.model_path_on_workers = None;
        setup.connect_and_load(file, self.require_all).await
    }

    /// Makes the loaded `file` the model requests are admitted for, and waits until the
    /// scheduler has retired the old model (closed its sessions) and serves it.
    async fn switch_to(
        &self,
        file: &Arc<ModelFile>,
        id: &str,
        loaded: LoadedModel,
        plan: Plan,
    ) -> Result<(), ModelChangeError> {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let epoch = {
            let mut served = self.served.write().unwrap_or_else(|e| e.into_inner());
            served.info = ModelInfo {
                id: id.to_string(),
                ctx_per_seq: served.info.ctx_per_seq,
                n_embd: file.config().n_embd,
                created,
                chat_template: file.chat_template(),
                pooling: file.pooling(),
            };
            served.tokenizer = file.tokenizer();
            served.file = Arc::clone(file);
            served.epoch += 1;
            served.loaded = true;
            served.epoch
        };
        let next = NextModel {
            model: Arc::clone(file),
            loaded,
            plan,
            epoch,
        };
        self.replace(Some(next), String::new()).await
    }

    /// Stops admitting requests, lets the admitted ones finish and closes the model's
    /// sessions; `why` is the health text meanwhile and afterwards.
    async fn retire(&self, why: String) -> Result<(), ModelChangeError> {
        {
            let mut served = self.served.write().unwrap_or_else(|e| e.into_inner());
            served.loaded = false;
            served.epoch += 1;
        }
        self.shared.set_health(Health::Unavailable(why.clone()));
        self.replace(None, why).await
    }

    async fn replace(&self, next: Option<NextModel>, why: String) -> Result<(), ModelChangeError> {
        let (done, switched) = oneshot::channel();
        self.control
            .send(Replace { next, why, done })
            .await
            .map_err(|_| ModelChangeError::ShuttingDown)?;
        switched.await.map_err(|_| ModelChangeError::ShuttingDown)
    }

    fn set_change(&self, model: &str, phase: &'static str, progress: Option<Arc<LoadProgress>>) {
        *self.change.lock().unwrap_or_else(|e| e.into_inner()) = Some(ChangeState {
            model: model.to_string(),
            phase,
            progress,
        });
    }

    fn clear_change(&self) {
        *self.change.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    /// The change under way and its progress.
    pub(crate) fn change_progress(&self) -> Option<ModelChange> {
        let change = self.change.lock().unwrap_or_else(|e| e.into_inner());
        let change = change.as_ref()?;
        let workers = change
            .progress
            .as_ref()
            .map(|p| p.snapshot())
            .unwrap_or_default();
        Some(ModelChange {
            model: change.model.clone(),
            phase: change.phase,
            bytes_loaded: workers.iter().map(|w| w.sent).sum(),
            bytes_total: workers.iter().map(|w| w.total).sum(),
        })
    }
}
