//! The background thread that creates warm instances off the request path: a queue of
//! jobs, run one at a time. It knows nothing of what a job warms, so the engine that
//! owns it and the policies that queue on it do not know each other through it.

use std::sync::mpsc::{Sender, channel};

/// A refill, queued by a policy.
type Job = Box<dyn FnOnce() + Send>;

/// Cheap to clone; the thread ends when the last clone (and the engine) is dropped.
#[derive(Clone)]
pub(crate) struct Warmer {
    tx: Sender<Job>,
}

impl Warmer {
    pub(crate) fn start() -> std::io::Result<Warmer> {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("policy-warmer".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    job();
                }
            })?;
        Ok(Warmer { tx })
    }

    /// Queues `job`; dropped unrun if the thread has ended.
    pub(crate) fn queue(&self, job: impl FnOnce() + Send + 'static) {
        let _ = self.tx.send(Box::new(job));
    }
}
