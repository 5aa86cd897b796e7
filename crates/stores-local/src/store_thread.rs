//! Writes on the Local committer's store thread, awaited from async code: what the
//! log, the offsets, the deliveries and the park index share.

use meshd_local::group::GroupCommit;
use meshd_local::KvEngine;
use std::sync::Arc;

/// Returns once every write submitted to the Local committer's store thread before
/// this call is applied (they are applied in order, and so is the empty one this
/// queues): a flush or a read that must see the buffered writes a caller submitted
/// without waiting for them (an ack's resolve) starts here. Its answer, whatever it
/// is (a fail-stopped committer refuses even an empty write), comes after theirs.
pub(crate) async fn applied_so_far(group: &Arc<GroupCommit>) {
    let _ = on_store_thread(group, meshd_local::group::Wait::Written, |_| {
        Ok::<_, meshd_local::LocalError>((meshd_local::Batch::new(), ()))
    })
    .await;
}

/// Runs a write on the Local committer's store thread
/// ([`GroupCommit::submit`](meshd_local::group::GroupCommit::submit)) and awaits its
/// answer: `(ticket, output)`, the ticket `None` for an empty batch.
pub(crate) async fn on_store_thread<T, E, F>(
    group: &Arc<GroupCommit>,
    wait: meshd_local::group::Wait,
    f: F,
) -> Result<(Option<u64>, T), E>
where
    T: Send + 'static,
    E: From<meshd_local::LocalError> + Send + 'static,
    F: FnOnce(&dyn KvEngine) -> Result<(meshd_local::Batch, T), E> + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    group.submit(wait, f, move |r| {
        let _ = tx.send(r);
    });
    match rx.await {
        Ok(r) => r,
        Err(_) => Err(meshd_local::LocalError::WriteFailed(
            "the Local store thread went away with this write queued".into(),
        )
        .into()),
    }
}
