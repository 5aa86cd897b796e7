//! Watches: a task per watcher that replays the change history from its next revision
//! whenever the committed revision moves. Reading history by revision (rather than
//! fanning out live events) makes a watch gap-free by construction: a slow watcher
//! never loses events, it only reads them later, until they are compacted away.

use crate::records::{self, history::HistoryRecord};
use crate::shared::{corrupt, read_error, read_state, Shared};
use futures::StreamExt;
use meshd_meta::{MetaError, WatchBatch, WatchError, WatchStream};
use std::sync::Arc;
use tokio::sync::{mpsc, watch};

/// At most this many revisions are read per step, so memory stays bounded.
const STEP: i64 = 512;

pub(crate) fn spawn(
    shared: Arc<Shared>,
    mut revision_rx: watch::Receiver<i64>,
    prefix: Vec<u8>,
    start: i64,
) -> WatchStream {
    let (tx, rx) = mpsc::channel::<Result<WatchBatch, WatchError>>(16);
    tokio::spawn(async move {
        let mut next = start;
        loop {
            let committed = *revision_rx.borrow_and_update();
            while next <= committed {
                let upto = committed.min(next + STEP - 1);
                let s = shared.clone();
                let p = prefix.clone();
                let step = tokio::task::spawn_blocking(move || read_step(&s, &p, next, upto)).await;
                let events = match step {
                    Ok(Ok(events)) => events,
                    Ok(Err(e)) => {
                        let _ = tx.send(Err(e)).await;
                        return;
                    }
                    Err(e) => {
                        let _ = tx.send(Err(WatchError::Unavailable(e.to_string()))).await;
                        return;
                    }
                };
                if !events.is_empty() && tx.send(Ok(WatchBatch { events })).await.is_err() {
                    return; // the consumer dropped the stream
                }
                next = upto + 1;
            }
            tokio::select! {
                changed = revision_rx.changed() => {
                    if changed.is_err() {
                        let _ = tx.send(Err(WatchError::Closed)).await;
                        return;
                    }
                }
                _ = tx.closed() => return,
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx).boxed()
}

/// The events under `prefix` of revisions `from..=to`, in order.
fn read_step(
    shared: &Shared,
    prefix: &[u8],
    from: i64,
    to: i64,
) -> Result<Vec<meshd_meta::WatchEvent>, WatchError> {
    let r = shared.read(|engine| {
        let state = read_state(engine)?;
        if from < state.history_start {
            return Ok(Err(WatchError::Compacted {
                compact_revision: state.history_start,
            }));
        }
        let rows = engine
            .scan(
                records::CF,
                &records::history_key(from),
                Some(&records::history_key(to + 1)),
                0,
            )
            .map_err(read_error)?;
        let mut events = Vec::new();
        let mut expected = from;
        for (k, v) in rows {
            let rec = HistoryRecord::decode(&v).map_err(|e| corrupt(&k, e))?;
            if rec.revision < expected {
                return Err(MetaError::Corrupt {
                    key: format!("history {}", rec.revision),
                    reason: "history out of order".into(),
                });
            }
            expected = rec.revision + 1;
            events.extend(
                rec.events
                    .into_iter()
                    .filter(|e| e.key().starts_with(prefix)),
            );
        }
        Ok(Ok(events))
    });
    match r {
        Ok(inner) => inner,
        Err(MetaError::Corrupt { key, reason }) => {
            Err(WatchError::Corrupt(format!("{key}: {reason}")))
        }
        Err(e) => Err(WatchError::Unavailable(e.to_string())),
    }
}
