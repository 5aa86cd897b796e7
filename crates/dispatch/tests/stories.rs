//! One story per delivery rule, told with a fake clock and asserted on commands.

mod common;

use common::*;
use meshd_dispatch::config::{backoff_cap, backoff_delay};
use meshd_dispatch::{
    AckOutcome, Command, Config, CoreError, DeliveryId, DeliveryRecord, DeliveryRef, DeliveryState,
    EventMeta, ExtendOutcome, FixedJitter, Input, NackOutcome, Partition, PartitionCore, Reply,
    RngJitter, SessionBinding, SessionCheck, Sources, ACK_TIMEOUT_REASON,
};
use meshd_stores::deadletters::entry_id;
use meshd_stores::park::HELD;
use meshd_stores::subscriptions::{Backoff, Filter, FilterExpr, Selector};

fn session(epoch: i64) -> SessionBinding {
    SessionBinding {
        session_id: "s-1".into(),
        epoch,
    }
}

fn record(offset: u64, attempt: u32, state: DeliveryState, deadline_ms: u64) -> DeliveryRecord {
    DeliveryRecord {
        key: key(),
        offset,
        attempt,
        delivery_id: format!("old-{offset}-{attempt}"),
        deadline_ms,
        last_reason: Some("boom".into()),
        first_delivered_at_ms: T0 - 10_000,
        state,
        owner_epoch: 11,
        session: None,
    }
}

// ---- write-ahead and attempts ------------------------------------------------------

#[test]
fn given_events_when_pulled_then_each_attempt_is_persisted_before_it_is_handed_out() {
    let mut s = Shell::new(config(), 0);
    s.publish(3);
    let records = s.pull(10);
    assert_eq!(
        records.iter().map(|r| r.offset).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    for r in &records {
        assert_eq!(r.attempt, 1);
        assert_eq!(r.state, DeliveryState::InFlight);
        assert_eq!(r.deadline_ms, T0 + 1000);
        assert_eq!(r.first_delivered_at_ms, T0);
        assert_eq!(r.owner_epoch, 11);
        assert_eq!(r.key, key());
    }
    assert_eq!(s.core.stats().persisting, 3);

    // Only offset 1's record is durable: only offset 1 is handed out.
    let cmds = s.input(Input::AttemptPersisted {
        offset: 1,
        attempt: 1,
    });
    let out = handouts(&cmds);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].offset, 1);
    assert_eq!(out[0].attempt, 1);
    assert_eq!(out[0].delivery_id, records[1].delivery_id);
    assert_eq!(out[0].deadline_ms, records[1].deadline_ms);
    let stats = s.core.stats();
    assert_eq!((stats.persisting, stats.in_flight), (2, 1));
}

#[test]
fn given_an_attempt_being_persisted_when_pulled_again_then_it_is_not_started_twice() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    assert_eq!(s.pull(10).len(), 1);
    assert!(s.pull(10).is_empty());
    // and an AttemptPersisted for another attempt number is misuse, not a hand-out
    let err = s.core.handle(
        Input::AttemptPersisted {
            offset: 0,
            attempt: 2,
        },
        s.now,
    );
    assert_eq!(
        err,
        Err(CoreError::NotPersisting {
            offset: 0,
            attempt: 2
        })
    );
}

#[test]
fn given_a_first_hand_out_then_attempt_is_1_and_every_attempt_has_a_fresh_id() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let first = s.deliver(1).remove(0);
    assert_eq!(first.attempt, 1);
    assert_eq!(
        DeliveryId::parse(&first.delivery_id).map(|d| d.partition),
        Some(3)
    );
    s.nack(&[&first.delivery_id], "no");
    s.advance(10_000);
    let second = s.deliver(1).remove(0);
    assert_eq!(second.attempt, 2);
    assert_ne!(second.delivery_id, first.delivery_id);
    assert!(
        second.delivery_id.starts_with("7-3-0-2-"),
        "{}",
        second.delivery_id
    );
    assert_eq!(DeliveryId::parse("not-an-id"), None);
}

#[test]
fn given_a_failed_persist_then_the_offset_is_ready_again_with_its_previous_count() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let r = s.pull(1).remove(0);
    let cmds = s.input(Input::PersistFailed {
        offset: 0,
        attempt: 1,
    });
    assert!(effects(&cmds).is_empty());
    assert_eq!(s.core.stats().waiting, 1, "due at once, still counted");
    let again = s.pull(1).remove(0);
    assert_eq!(
        again.attempt, 1,
        "never handed out, so still the first attempt"
    );
    assert_ne!(again.delivery_id, r.delivery_id);
}

// ---- acks and the committed offset -------------------------------------------------

// ---- byte budgets and released hand-outs ----------------------------------------

#[test]
fn given_a_byte_budget_then_deliveries_are_taken_in_order_until_the_next_would_pass_it() {
    let mut s = Shell::new(config(), 0);
    s.publish_sized(&[400, 300, 200, 100]);
    let offsets = |r: &[DeliveryRecord]| r.iter().map(|r| r.offset).collect::<Vec<_>>();
    // 400 + 300 = 700 fits 750; 200 more would pass it, and offset 3 is not taken
    // past offset 2 although it would fit.
    assert_eq!(offsets(&s.pull_bytes(10, 750, true)), [0, 1]);
    assert_eq!(
        s.core.stats().persisting,
        2,
        "only what is taken is an attempt"
    );
    // An event larger than the whole budget still goes out first, alone...
    assert_eq!(offsets(&s.pull_bytes(10, 50, true)), [2]);
    // ... but not when the caller already has deliveries from elsewhere.
    assert!(s.pull_bytes(10, 50, false).is_empty());
    assert_eq!(offsets(&s.pull_bytes(10, 100, false)), [3]);
}

#[test]
fn given_an_event_of_unknown_size_then_the_budget_counts_the_largest_event() {
    let mut cfg = config();
    cfg.unknown_size_bytes = 1000;
    // Offset 0 was in flight before a restart: its size is not known until the log
    // is read there again (not yet: the shell below does not serve reads).
    let records = vec![record(0, 1, DeliveryState::WaitingRetry, T0)];
    let (mut s, _) = Shell::recovered(cfg, 0, records, T0, 0);
    let pull_id = s.pull_id();
    let cmds = s.raw(Input::Pull {
        pull_id,
        max_events: 10,
        max_bytes: 999,
        at_least_one: false,
        session: None,
    });
    assert!(
        persists(&cmds).is_empty(),
        "an unknown size is not guessed low"
    );
    let pull_id = s.pull_id();
    let cmds = s.raw(Input::Pull {
        pull_id,
        max_events: 10,
        max_bytes: 1000,
        at_least_one: false,
        session: None,
    });
    assert_eq!(persists(&cmds).len(), 1);
}

#[test]
fn given_a_released_hand_out_then_it_is_due_at_once_with_the_same_attempt_and_the_old_id_is_unknown(
) {
    let mut cfg = config();
    cfg.max_attempts = 1;
    let mut s = Shell::new(cfg, 0);
    s.publish(1);
    let first = s.deliver(1);
    assert_eq!(first[0].attempt, 1);
    let cmds = s.input(Input::Release(vec![
        first[0].delivery_id.clone(),
        "5-0-0-1-ffffffffffffffff".into(),
    ]));
    assert_eq!(
        replies(&cmds),
        [
            Reply::Release {
                delivery_id: first[0].delivery_id.clone(),
                released: true
            },
            Reply::Release {
                delivery_id: "5-0-0-1-ffffffffffffffff".into(),
                released: false
            }
        ]
    );
    // Due at once (no lease to wait for), and with max_attempts 1 not dead-lettered:
    // the released attempt never reached anyone, so it did not count.
    let again = s.deliver(1);
    assert_eq!(again.len(), 1, "due again at once");
    assert_eq!(again[0].offset, 0);
    assert_eq!(again[0].attempt, 1, "the released attempt did not count");
    assert_ne!(again[0].delivery_id, first[0].delivery_id);
    let acked = s.ack(&[&first[0].delivery_id]);
    assert_eq!(
        replies(&acked),
        [Reply::Ack {
            delivery_id: first[0].delivery_id.clone(),
            outcome: AckOutcome::Unknown
        }]
    );
    // Releasing it twice changes nothing the second time.
    let cmds = s.input(Input::Release(vec![first[0].delivery_id.clone()]));
    assert_eq!(
        replies(&cmds),
        [Reply::Release {
            delivery_id: first[0].delivery_id.clone(),
            released: false
        }]
    );
}

#[test]
fn given_7_acked_while_5_in_flight_when_5_is_acked_then_one_resolve_removes_5_to_7_and_advances_to_8(
) {
    let mut s = Shell::new(config(), 5);
    s.publish(3); // offsets 5, 6, 7
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [5, 6, 7]);

    let cmds = s.ack(&[&d[2].delivery_id]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    let u = updates(&cmds);
    assert_eq!(u.len(), 1);
    assert_eq!(
        (u[0].offset, u[0].state),
        (7, DeliveryState::AckedAwaitingCommit)
    );
    assert!(resolves(&cmds).is_empty());
    assert_eq!(s.core.committed(), 5);

    let cmds = s.ack(&[&d[1].delivery_id]);
    assert_eq!(updates(&cmds)[0].offset, 6);
    assert_eq!(s.core.committed(), 5);
    assert_eq!(s.core.stats().acked_awaiting, 2);

    let cmds = s.ack(&[&d[0].delivery_id]);
    assert!(
        updates(&cmds).is_empty(),
        "5 is resolved and removed at once"
    );
    assert_eq!(resolves(&cmds), [(vec![5, 6, 7], Some(8))]);
    assert_eq!(s.core.committed(), 8);
    assert_eq!(s.core.stats().acked_awaiting, 0);
    // The reply comes after the write it reports.
    let resolve_at = cmds
        .iter()
        .position(|c| matches!(c, Command::Resolve { .. }));
    let reply_at = cmds.iter().position(|c| matches!(c, Command::Reply(_)));
    assert!(resolve_at < reply_at);
}

#[test]
fn given_acks_in_one_batch_that_close_the_gap_then_one_resolve_and_no_updates() {
    let mut s = Shell::new(config(), 0);
    s.publish(4);
    let d = s.deliver(10);
    let ids: Vec<&str> = [2, 0, 1]
        .iter()
        .map(|&i| d[i].delivery_id.as_str())
        .collect();
    let cmds = s.ack(&ids);
    assert!(updates(&cmds).is_empty());
    assert_eq!(resolves(&cmds), [(vec![0, 1, 2], Some(3))]);
    assert_eq!(ack_outcomes(&cmds), vec![AckOutcome::Acked; 3]);
}

#[test]
fn given_an_acked_delivery_when_acked_again_then_unknown() {
    let mut s = Shell::new(config(), 0);
    s.publish(2);
    let d = s.deliver(2);
    s.ack(&[&d[1].delivery_id]);
    let cmds = s.ack(&[&d[1].delivery_id]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Unknown]);
    assert!(effects(&cmds).is_empty());
}

#[test]
fn given_a_superseded_attempt_when_it_is_acked_then_unknown_and_nothing_changes() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let first = s.deliver(1).remove(0);
    s.advance(1000); // lease ends
    let cmds = s.tick();
    let u = updates(&cmds);
    assert_eq!(u[0].state, DeliveryState::WaitingRetry);
    assert_eq!(u[0].last_reason.as_deref(), Some(ACK_TIMEOUT_REASON));
    s.advance(100);
    let second = s.deliver(1).remove(0);
    assert_eq!(second.attempt, 2);

    for cmds in [
        s.ack(&[&first.delivery_id]),
        s.nack(&[&first.delivery_id], "late"),
    ] {
        assert!(effects(&cmds).is_empty(), "{cmds:?}");
    }
    assert_eq!(
        ack_outcomes(&s.ack(&[&first.delivery_id])),
        [AckOutcome::Unknown]
    );
    assert_eq!(s.core.committed(), 0);
    assert_eq!(s.core.stats().in_flight, 1);
}

#[test]
fn given_unknown_ids_when_acked_nacked_or_extended_then_unknown() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    s.deliver(1);
    let cmds = s.ack(&["nope"]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Unknown]);
    let cmds = s.nack(&["7-3-0-1-00000000000000ff"], "x");
    assert_eq!(nack_outcomes(&cmds), [NackOutcome::Unknown]);
    let cmds = s.input(Input::Extend {
        deliveries: vec![DeliveryRef::unbound("nope")],
        ack_timeout_ms: 5000,
    });
    assert_eq!(
        cmds,
        [Command::Reply(Reply::Extend {
            delivery_id: "nope".into(),
            outcome: ExtendOutcome::Unknown
        })]
    );
}

#[test]
fn given_a_lease_ran_out_but_no_redelivery_yet_when_acked_then_acked() {
    // Not superseded yet: accepting the late ack saves a redelivery.
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let d = s.deliver(1).remove(0);
    s.advance(1050);
    let cmds = s.ack(&[&d.delivery_id]);
    // The timeout fires first (WaitingRetry), then the ack resolves it.
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))]);
}

// ---- retries and backoff -----------------------------------------------------------

#[test]
fn given_repeated_nacks_then_the_backoff_doubles_up_to_the_cap() {
    let mut cfg = config();
    cfg.max_attempts = 7;
    cfg.backoff = Backoff {
        initial_ms: 100,
        max_ms: 500,
    };
    let mut s = Shell::new(cfg, 0);
    s.publish(1);
    let mut delays = Vec::new();
    for _ in 0..6 {
        let d = s.deliver(1).remove(0);
        let cmds = s.nack(&[&d.delivery_id], "try later");
        let [NackOutcome::Retrying { due_ms }] = nack_outcomes(&cmds)[..] else {
            panic!("{cmds:?}")
        };
        let u = updates(&cmds);
        assert_eq!(u[0].state, DeliveryState::WaitingRetry);
        assert_eq!(u[0].deadline_ms, due_ms);
        assert_eq!(u[0].last_reason.as_deref(), Some("try later"));
        delays.push(due_ms - s.now);
        // not before it is due
        s.at(due_ms - 1);
        assert!(s.pull(1).is_empty());
        s.at(due_ms);
    }
    // FixedJitter::Max: exactly the cap each time.
    assert_eq!(delays, [100, 200, 400, 500, 500, 500]);
}

#[test]
fn given_a_nack_with_a_delay_then_that_retry_waits_the_delay_instead_of_the_backoff_and_still_counts(
) {
    let mut cfg = config();
    cfg.max_attempts = 3;
    cfg.backoff = Backoff {
        initial_ms: 100,
        max_ms: 500,
    };
    let mut s = Shell::new(cfg, 0);
    s.publish(2);
    let nack = |s: &mut Shell, id: &str, delay_ms| {
        s.input(Input::Nack {
            deliveries: vec![DeliveryRef::unbound(id)],
            reason: "later".into(),
            delay_ms,
        })
    };
    // A delay longer than the backoff: due exactly then, recorded so, and the later
    // offset goes out meanwhile.
    let first = s.deliver(1).remove(0);
    let cmds = nack(&mut s, &first.delivery_id, Some(60_000));
    let [NackOutcome::Retrying { due_ms }] = nack_outcomes(&cmds)[..] else {
        panic!("{cmds:?}")
    };
    assert_eq!(due_ms, s.now + 60_000);
    let u = updates(&cmds);
    assert_eq!(
        (u[0].state, u[0].deadline_ms),
        (DeliveryState::WaitingRetry, due_ms)
    );
    s.at(due_ms - 1);
    let later = s.pull(2);
    assert_eq!(later.iter().map(|d| d.offset).collect::<Vec<_>>(), [1]);
    s.at(due_ms);
    let second = s.deliver(1).remove(0);
    assert_eq!((second.offset, second.attempt), (0, 2));
    // A delay of 0: due at once, not after the backoff.
    let cmds = nack(&mut s, &second.delivery_id, Some(0));
    assert_eq!(
        nack_outcomes(&cmds),
        [NackOutcome::Retrying { due_ms: s.now }]
    );
    let third = s.deliver(1).remove(0);
    assert_eq!((third.offset, third.attempt), (0, 3));
    // It still counts: the max_attempts-th failure dead-letters, whatever the delay.
    let cmds = nack(&mut s, &third.delivery_id, Some(1000));
    assert_eq!(nack_outcomes(&cmds), [NackOutcome::DeadLettering]);
}

#[test]
fn given_equal_jitter_then_every_delay_lies_between_half_the_cap_and_the_cap() {
    let b = Backoff {
        initial_ms: 1000,
        max_ms: 60_000,
    };
    assert_eq!(backoff_cap(b, 1), 1000);
    assert_eq!(backoff_cap(b, 3), 4000);
    assert_eq!(backoff_cap(b, 7), 60_000);
    assert_eq!(backoff_cap(b, 1000), 60_000, "no overflow at large counts");
    assert_eq!(backoff_delay(b, 3, &mut FixedJitter::Min), 2000);
    assert_eq!(backoff_delay(b, 3, &mut FixedJitter::Max), 4000);
    let mut j = RngJitter::seeded(42);
    let samples: Vec<u64> = (0..500).map(|_| backoff_delay(b, 3, &mut j)).collect();
    assert!(samples.iter().all(|d| (2000..=4000).contains(d)));
    assert!(samples.iter().any(|d| *d != samples[0]), "jitter spreads");
    // the same seed gives the same delays
    let mut again = RngJitter::seeded(42);
    let replay: Vec<u64> = (0..500).map(|_| backoff_delay(b, 3, &mut again)).collect();
    assert_eq!(samples, replay);
}

#[test]
fn given_a_retry_waiting_for_its_backoff_when_pulled_then_later_offsets_go_out() {
    let mut s = Shell::new(config(), 0);
    s.publish(3);
    let first = s.deliver(1).remove(0);
    assert_eq!(first.offset, 0);
    s.nack(&[&first.delivery_id], "busy"); // due in 100 ms
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [1, 2], "offset 0 does not hold back 1 and 2");
    assert_eq!(s.core.committed(), 0);
    s.advance(100);
    let d = s.deliver(10);
    assert_eq!((offsets(&d), d[0].attempt), (vec![0], 2));
}

#[test]
fn given_a_due_retry_and_later_pending_offsets_when_pulled_then_offset_order() {
    let mut s = Shell::new(config(), 0);
    s.publish(2);
    let d0 = s.deliver(1).remove(0);
    s.nack(&[&d0.delivery_id], "busy");
    s.advance(100);
    s.publish(1);
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 1, 2]);
    assert_eq!(d.iter().map(|d| d.attempt).collect::<Vec<_>>(), [2, 1, 1]);
}

#[test]
fn given_a_pull_for_fewer_events_than_ready_then_the_lowest_offsets() {
    let mut s = Shell::new(config(), 0);
    s.publish(5);
    assert_eq!(offsets(&s.deliver(2)), [0, 1]);
    assert_eq!(offsets(&s.deliver(2)), [2, 3]);
}

// ---- dead letters ------------------------------------------------------------------

#[test]
fn given_max_attempts_3_when_the_third_delivery_fails_then_it_is_dead_lettered_not_handed_out_a_fourth_time(
) {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let mut handed = 0;
    let mut last = None;
    for attempt in 1..=3 {
        let d = s.deliver(1);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].attempt, attempt);
        handed += 1;
        let cmds = s.nack(&[&d[0].delivery_id], &format!("fail {attempt}"));
        last = Some(cmds);
        s.advance(10_000);
    }
    let cmds = last.unwrap();
    assert_eq!(nack_outcomes(&cmds), [NackOutcome::DeadLettering]);
    let dl = dead_letters(&cmds);
    assert_eq!(dl.len(), 1);
    assert_eq!(dl[0].offset, 0);
    assert_eq!(dl[0].attempts, 3);
    assert_eq!(dl[0].reason, "fail 3");
    assert_eq!(dl[0].first_attempt_at_ms, T0);
    let u = updates(&cmds);
    assert_eq!(u[0].state, DeliveryState::DeadLettering);
    assert_eq!(handed, 3);
    assert!(s.deliver(10).is_empty(), "no fourth hand-out");
    assert_eq!(s.core.stats().dead_lettering, 1);

    let cmds = s.input(Input::DeadLettered { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))]);
    assert_eq!(s.core.committed(), 1);
}

#[test]
fn given_the_last_lease_runs_out_then_it_is_dead_lettered_with_reason_ack_timeout() {
    let mut cfg = config();
    cfg.max_attempts = 1;
    let mut s = Shell::new(cfg, 0);
    s.publish(1);
    s.deliver(1);
    s.advance(1000);
    let cmds = s.tick();
    let dl = dead_letters(&cmds);
    assert_eq!(dl.len(), 1);
    assert_eq!(
        (dl[0].attempts, dl[0].reason.as_str()),
        (1, ACK_TIMEOUT_REASON)
    );
}

#[test]
fn given_the_dead_letter_store_is_unavailable_then_the_delivery_is_held_and_retried_after_a_backoff(
) {
    let mut cfg = config();
    cfg.max_attempts = 1;
    let mut s = Shell::new(cfg, 0);
    s.publish(2);
    let d = s.deliver(1).remove(0);
    let cmds = s.nack(&[&d.delivery_id], "bad");
    assert_eq!(dead_letters(&cmds).len(), 1);

    let cmds = s.input(Input::DeadLetterUnavailable { offset: 0 });
    assert!(effects(&cmds).is_empty());
    assert_eq!(s.core.next_wakeup(), Some(s.now + 100));
    // Held: not redelivered, not resolved; offset 1 still goes out.
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [1]);
    assert_eq!(s.core.committed(), 0);
    assert_eq!(s.core.stats().dead_lettering, 1);
    // A second outcome for the same write is misuse.
    assert_eq!(
        s.core.handle(Input::DeadLettered { offset: 0 }, s.now),
        Err(CoreError::NotDeadLettering { offset: 0 })
    );

    s.advance(99);
    assert!(dead_letters(&s.tick()).is_empty());
    s.advance(1);
    let cmds = s.tick();
    assert_eq!(
        dead_letters(&cmds).len(),
        1,
        "asked again after the backoff"
    );
    // Unavailable again: the backoff doubles.
    s.input(Input::DeadLetterUnavailable { offset: 0 });
    assert_eq!(s.core.next_wakeup(), Some(s.now + 200));
    s.advance(200);
    assert_eq!(dead_letters(&s.tick()).len(), 1);
    let cmds = s.input(Input::DeadLettered { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))]);
}

#[test]
fn given_a_dead_letter_above_a_gap_then_it_waits_as_acked_awaiting_commit() {
    let mut cfg = config();
    cfg.max_attempts = 1;
    let mut s = Shell::new(cfg, 0);
    s.publish(2);
    let d = s.deliver(2);
    s.nack(&[&d[1].delivery_id], "bad");
    let cmds = s.input(Input::DeadLettered { offset: 1 });
    let u = updates(&cmds);
    assert_eq!(
        (u[0].offset, u[0].state),
        (1, DeliveryState::AckedAwaitingCommit)
    );
    assert_eq!(u[0].deadline_ms, u64::MAX, "never due");
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(resolves(&cmds), [(vec![0, 1], Some(2))]);
}

// ---- filters -----------------------------------------------------------------------

#[test]
fn given_a_filter_when_events_do_not_match_then_they_are_resolved_without_any_attempt() {
    let mut cfg = config();
    cfg.selector = Selector::new(
        Some(&Filter {
            event_type: Some("order.created".into()),
            source: None,
        }),
        &[],
    );
    let mut s = Shell::new(cfg, 0);
    let cmds = s.publish_typed(&[
        ("order.deleted", "/a"),
        ("order.deleted", "/b"),
        ("order.created", "/a"),
        ("order.deleted", "/c"),
    ]);
    // 0 and 1 are resolved at once: the offset moves without any record.
    assert_eq!(resolves(&cmds), [(vec![], Some(2))]);
    assert!(updates(&cmds).is_empty() && persists(&cmds).is_empty());
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [2]);
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(resolves(&cmds), [(vec![2], Some(4))], "3 was filtered");
}

#[test]
fn given_a_source_filter_then_only_that_source_is_delivered() {
    let mut cfg = config();
    cfg.selector = Selector::new(
        Some(&Filter {
            event_type: None,
            source: Some("/shop".into()),
        }),
        &[],
    );
    assert!(cfg.matches(&typed(0, "anything", "/shop")));
    assert!(!cfg.matches(&typed(0, "anything", "/other")));
    cfg.selector = Selector::default();
    assert!(cfg.matches(&typed(0, "x", "y")));
}

#[test]
fn given_filters_and_the_shorthand_then_all_of_them_must_match() {
    let mut cfg = config();
    cfg.selector = Selector::new(
        Some(&Filter {
            event_type: None,
            source: Some("/shop".into()),
        }),
        &[
            FilterExpr::Prefix(vec![("type".into(), "order.".into())]),
            FilterExpr::Not(Box::new(FilterExpr::Suffix(vec![(
                "type".into(),
                ".deleted".into(),
            )]))),
        ],
    );
    let mut s = Shell::new(cfg, 0);
    let cmds = s.publish_typed(&[
        ("order.created", "/shop"),
        ("order.deleted", "/shop"),
        ("invoice.created", "/shop"),
        ("order.created", "/other"),
        ("order.paid", "/shop"),
    ]);
    assert!(
        persists(&cmds).is_empty(),
        "nothing recorded for filtered events"
    );
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 4]);
    let ids: Vec<&str> = d.iter().map(|d| d.delivery_id.as_str()).collect();
    let cmds = s.ack(&ids);
    assert_eq!(resolves(&cmds).last().map(|r| r.1), Some(Some(5)));
}

// ---- bounds ------------------------------------------------------------------------

#[test]
fn given_max_in_flight_reached_then_nothing_new_is_read_or_handed_out() {
    let mut cfg = config();
    cfg.max_in_flight = 2;
    cfg.read_batch = 1;
    let mut s = Shell::new(cfg, 0);
    let cmds = s.publish(5);
    // Reads go on while nothing is outstanding (the window bounds them).
    assert_eq!(reads(&cmds).len(), 5);
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 1]);
    assert!(s.deliver(10).is_empty(), "back-pressure");
    let cmds = s.publish(1);
    assert!(reads(&cmds).is_empty(), "no reads at the bound");
    assert_eq!(s.core.stats().outstanding, 2);

    // A waiting retry still counts, but is itself handed out again when due.
    s.nack(&[&d[0].delivery_id], "x");
    assert!(s.deliver(10).is_empty());
    s.advance(100);
    assert_eq!(offsets(&s.deliver(10)), [0]);

    // An ack makes room.
    let cmds = s.ack(&[&d[1].delivery_id]);
    assert_eq!(reads(&cmds), [(5, 1)], "room: read again");
    assert_eq!(offsets(&s.deliver(10)), [2]);
}

#[test]
fn given_the_window_is_full_then_nothing_is_read_until_the_committed_offset_moves() {
    let mut cfg = config();
    cfg.max_window = 3;
    let mut s = Shell::new(cfg, 0);
    let cmds = s.publish(10);
    assert_eq!(reads(&cmds), [(0, 3)]);
    assert_eq!(s.core.stats().next_to_read, 3);
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 1, 2]);
    // Acking above the gap frees nothing: the window is counted from committed.
    let cmds = s.ack(&[&d[2].delivery_id]);
    assert!(reads(&cmds).is_empty());
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(reads(&cmds), [(3, 1)]);
    assert_eq!(s.core.stats().backlog, 9);
}

#[test]
fn given_a_long_backlog_and_no_pulls_then_only_max_pending_events_are_read_ahead() {
    let mut cfg = config();
    cfg.read_batch = 2;
    cfg.max_pending = 3;
    let mut s = Shell::new(cfg, 0);
    // Reads stop once 3 or more events wait for a pull (2 + 2 here), whatever the log
    // holds: an idle subscription holds its read-ahead, not its backlog.
    s.publish(100);
    assert_eq!(s.core.stats().pending, 4);
    assert_eq!(s.core.stats().next_to_read, 4);
    // A pull takes them and makes room: the reading goes on.
    let d = s.deliver(4);
    assert_eq!(offsets(&d), [0, 1, 2, 3]);
    assert_eq!(s.core.stats().pending, 4);
    assert_eq!(s.core.stats().next_to_read, 8);
}

// ---- sessions ----------------------------------------------------------------------

#[test]
fn given_a_session_taken_over_when_the_old_session_acks_then_fenced_and_nothing_changes() {
    let mut s = Shell::new(config(), 0);
    s.publish(3);
    let d = s.deliver_with(3, session(40));
    assert_eq!(d[0].session, Some(session(40)));
    assert_eq!(s.core.bound_session(&d[0].delivery_id), Some(&session(40)));

    // Taken over: the shell's cache says s-1 is now fenced (or at another epoch).
    let stale = |id: &str, epoch: Option<i64>| {
        DeliveryRef::checked(
            id,
            SessionCheck {
                session_id: "s-1".into(),
                current_epoch: epoch,
            },
        )
    };
    let cmds = s.input(Input::Ack(vec![
        stale(&d[0].delivery_id, None),
        stale(&d[1].delivery_id, Some(41)),
        DeliveryRef::unbound(d[2].delivery_id.clone()),
    ]));
    assert_eq!(ack_outcomes(&cmds), vec![AckOutcome::Fenced; 3]);
    assert!(effects(&cmds).is_empty());
    let cmds = s.input(Input::Nack {
        deliveries: vec![stale(&d[0].delivery_id, None)],
        reason: "x".into(),
        delay_ms: None,
    });
    assert_eq!(nack_outcomes(&cmds), [NackOutcome::Fenced]);
    let cmds = s.input(Input::Extend {
        deliveries: vec![stale(&d[0].delivery_id, Some(41))],
        ack_timeout_ms: 5000,
    });
    assert!(matches!(
        &cmds[..],
        [Command::Reply(Reply::Extend {
            outcome: ExtendOutcome::Fenced,
            ..
        })]
    ));
    // Another session naming itself is fenced too.
    let other = DeliveryRef::checked(
        d[0].delivery_id.clone(),
        SessionCheck {
            session_id: "s-2".into(),
            current_epoch: Some(40),
        },
    );
    assert_eq!(
        ack_outcomes(&s.input(Input::Ack(vec![other]))),
        [AckOutcome::Fenced]
    );

    // The live session at its epoch acks fine.
    let cmds = s.input(Input::Ack(vec![stale(&d[0].delivery_id, Some(40))]));
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))]);
}

#[test]
fn given_unbound_deliveries_then_session_checks_are_not_needed() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let d = s.deliver(1).remove(0);
    assert_eq!(s.core.bound_session(&d.delivery_id), None);
    let any = DeliveryRef::checked(
        d.delivery_id.clone(),
        SessionCheck {
            session_id: "whoever".into(),
            current_epoch: None,
        },
    );
    assert_eq!(
        ack_outcomes(&s.input(Input::Ack(vec![any]))),
        [AckOutcome::Acked]
    );
}

// ---- extend ------------------------------------------------------------------------

#[test]
fn given_extend_then_the_lease_is_pushed_out_and_recorded() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let d = s.deliver(1).remove(0);
    s.advance(900);
    let cmds = s.input(Input::Extend {
        deliveries: vec![DeliveryRef::unbound(d.delivery_id.clone())],
        ack_timeout_ms: 5000,
    });
    let deadline = s.now + 5000;
    let u = updates(&cmds);
    assert_eq!(
        (u[0].state, u[0].deadline_ms),
        (DeliveryState::InFlight, deadline)
    );
    assert!(cmds.contains(&Command::Reply(Reply::Extend {
        delivery_id: d.delivery_id.clone(),
        outcome: ExtendOutcome::Extended {
            deadline_ms: deadline
        }
    })));
    assert_eq!(s.core.next_wakeup(), Some(deadline));
    // A shorter extension never shortens the lease.
    let cmds = s.input(Input::Extend {
        deliveries: vec![DeliveryRef::unbound(d.delivery_id.clone())],
        ack_timeout_ms: 100,
    });
    assert_eq!(updates(&cmds)[0].deadline_ms, deadline);
    s.advance(4999);
    assert!(
        effects(&s.tick()).is_empty(),
        "no timeout before the new deadline"
    );
    s.advance(1);
    let cmds = s.tick();
    assert_eq!(updates(&cmds)[0].state, DeliveryState::WaitingRetry);
    // An ended lease cannot be extended.
    let cmds = s.input(Input::Extend {
        deliveries: vec![DeliveryRef::unbound(d.delivery_id.clone())],
        ack_timeout_ms: 5000,
    });
    assert!(matches!(
        &cmds[..],
        [Command::Reply(Reply::Extend {
            outcome: ExtendOutcome::Unknown,
            ..
        })]
    ));
    assert_eq!(
        s.core.handle(
            Input::Extend {
                deliveries: vec![],
                ack_timeout_ms: 99
            },
            s.now
        ),
        Err(CoreError::InvalidAckTimeout { ms: 99 })
    );
}

// ---- recovery ----------------------------------------------------------------------

#[test]
fn given_a_recovered_in_flight_record_then_it_is_due_at_its_persisted_deadline_with_the_next_attempt(
) {
    let records = vec![record(2, 2, DeliveryState::InFlight, T0 + 500)];
    let (mut s, cmds) = Shell::recovered(config(), 2, records, T0, 4);
    assert!(reads(&cmds).is_empty(), "the log end is not known yet");
    s.input(Input::LogEnd(4));
    // Offset 3 (no record) goes out; 2 is still leased.
    assert_eq!(offsets(&s.deliver(10)), [3]);
    assert_eq!(s.core.next_wakeup(), Some(T0 + 500));
    // The consumer that held it before the crash may still ack it... but let it lapse.
    s.at(T0 + 500);
    let d = s.deliver(10);
    assert_eq!((offsets(&d), d[0].attempt), (vec![2], 3));
}

#[test]
fn given_a_recovered_in_flight_record_then_its_delivery_id_can_still_be_acked() {
    let records = vec![record(2, 1, DeliveryState::InFlight, T0 + 500)];
    let (mut s, _) = Shell::recovered(config(), 2, records, T0, 3);
    let cmds = s.ack(&["old-2-1"]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    assert_eq!(resolves(&cmds), [(vec![2], Some(3))]);
}

#[test]
fn given_a_recovered_in_flight_record_whose_deadline_passed_then_it_is_due_at_once() {
    let records = vec![record(0, 1, DeliveryState::InFlight, T0 - 1)];
    let (mut s, cmds) = Shell::recovered(config(), 0, records, T0, 1);
    let u = updates(&cmds);
    assert_eq!(
        (u[0].state, u[0].deadline_ms),
        (DeliveryState::WaitingRetry, T0)
    );
    let d = s.deliver(1);
    assert_eq!((d[0].offset, d[0].attempt), (0, 2));
}

#[test]
fn given_a_recovered_waiting_record_then_it_is_due_at_its_time() {
    let records = vec![record(0, 2, DeliveryState::WaitingRetry, T0 + 300)];
    let (mut s, _) = Shell::recovered(config(), 0, records, T0, 1);
    s.input(Input::LogEnd(1));
    assert!(s.deliver(1).is_empty());
    assert_eq!(s.core.next_wakeup(), Some(T0 + 300));
    s.at(T0 + 300);
    let d = s.deliver(1);
    assert_eq!(d[0].attempt, 3);
}

#[test]
fn given_a_recovered_acked_awaiting_commit_record_then_it_is_never_redelivered_and_goes_when_the_gap_closes(
) {
    let records = vec![record(1, 1, DeliveryState::AckedAwaitingCommit, u64::MAX)];
    let (mut s, cmds) = Shell::recovered(config(), 0, records, T0, 3);
    assert!(resolves(&cmds).is_empty());
    s.input(Input::LogEnd(3));
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 2], "1 is not delivered again");
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(resolves(&cmds), [(vec![0, 1], Some(2))]);
}

#[test]
fn given_a_recovered_acked_record_at_the_committed_offset_then_recovery_resolves_it() {
    let records = vec![record(4, 1, DeliveryState::AckedAwaitingCommit, u64::MAX)];
    let (s, cmds) = Shell::recovered(config(), 4, records, T0, 5);
    assert_eq!(resolves(&cmds), [(vec![4], Some(5))]);
    assert_eq!(s.core.committed(), 5);
}

#[test]
fn given_a_recovered_dead_lettering_record_then_its_dead_letter_is_emitted_again() {
    let records = vec![record(0, 3, DeliveryState::DeadLettering, T0 - 5)];
    let (mut s, cmds) = Shell::recovered(config(), 0, records, T0, 1);
    let dl = dead_letters(&cmds);
    assert_eq!(dl.len(), 1);
    assert_eq!(
        (
            dl[0].offset,
            dl[0].attempts,
            dl[0].reason.as_str(),
            dl[0].first_attempt_at_ms
        ),
        (0, 3, "boom", T0 - 10_000)
    );
    s.input(Input::LogEnd(1));
    assert!(s.deliver(1).is_empty(), "held, not redelivered");
    let cmds = s.input(Input::DeadLettered { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))]);
}

#[test]
fn given_offsets_without_a_record_then_they_are_delivered_again_from_attempt_1() {
    let (mut s, cmds) = Shell::recovered(config(), 3, vec![], T0, 3);
    assert!(cmds.is_empty());
    s.log.extend((3..5).map(event));
    s.input(Input::LogEnd(5));
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [3, 4]);
    assert!(d.iter().all(|d| d.attempt == 1));
}

#[test]
fn given_a_recovered_last_attempt_whose_lease_ends_then_it_is_dead_lettered_not_handed_out() {
    let records = vec![record(0, 3, DeliveryState::InFlight, T0 + 10)];
    let (mut s, _) = Shell::recovered(config(), 0, records, T0, 1);
    s.at(T0 + 10);
    let cmds = s.tick();
    assert_eq!(dead_letters(&cmds)[0].attempts, 3);
    assert!(s.deliver(1).is_empty());
}

#[test]
fn given_a_lowered_max_attempts_then_a_recovered_retry_is_dead_lettered_instead_of_handed_out() {
    let mut cfg = config();
    cfg.max_attempts = 2;
    let records = vec![record(0, 2, DeliveryState::WaitingRetry, T0)];
    let (mut s, _) = Shell::recovered(cfg, 0, records, T0, 1);
    let pull_id = s.pull_id();
    let cmds = s.input(Input::Pull {
        pull_id,
        max_events: 5,
        max_bytes: u64::MAX,
        at_least_one: true,
        session: None,
    });
    assert!(persists(&cmds).is_empty());
    assert_eq!(dead_letters(&cmds)[0].attempts, 2);
}

#[test]
fn given_invalid_records_then_recovery_refuses_them() {
    let mut foreign = record(0, 1, DeliveryState::InFlight, T0);
    foreign.key.partition = 4;
    let zero = record(1, 0, DeliveryState::InFlight, T0);
    let dup = record(2, 1, DeliveryState::InFlight, T0);
    for (records, want) in [
        (vec![foreign], "another partition"),
        (vec![zero], "attempt 0"),
        (vec![dup.clone(), dup], "two recovered"),
    ] {
        let err = PartitionCore::recover(
            partition(),
            config(),
            0,
            records,
            &Default::default(),
            T0,
            Sources::deterministic(0, FixedJitter::Max),
        )
        .err()
        .expect("refused");
        assert!(err.to_string().contains(want), "{err}");
    }
}

// ---- redrive -----------------------------------------------------------------------

fn dead_lettered_offset_0() -> Shell {
    let mut cfg = config();
    cfg.max_attempts = 2;
    let mut s = Shell::new(cfg, 0);
    s.publish(2);
    let d = s.deliver(1).remove(0);
    s.nack(&[&d.delivery_id], "one");
    s.advance(1000);
    let d = s.deliver(1).remove(0);
    assert_eq!(d.attempt, 2);
    s.nack(&[&d.delivery_id], "two");
    s.input(Input::DeadLettered { offset: 0 });
    assert_eq!(s.core.committed(), 1);
    s
}

fn entry0() -> String {
    entry_id("instance-1", 7, "orders", 3, 0)
}

#[test]
fn given_a_redriven_event_when_acked_then_the_entry_is_settled_and_the_offset_is_untouched() {
    let mut s = dead_lettered_offset_0();
    assert_eq!(partition().dead_letter_id(0), entry0());
    let cmds = s.input(Input::Redrive {
        entry_id: entry0(),
        offset: 0,
    });
    assert!(effects(&cmds).is_empty());
    assert_eq!(s.core.stats().redrives, 1);
    // Redrives go first; offset 1 follows.
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 1]);
    assert_eq!(d[0].attempt, 1, "a fresh attempt count");
    assert_eq!(d[0].redrive_of, Some(entry0()));
    assert_eq!(d[1].redrive_of, None);
    assert!(d[0].delivery_id.starts_with("7-3-0-r1-"));
    assert_eq!(
        DeliveryId::parse(&d[0].delivery_id).map(|d| d.partition),
        Some(3)
    );

    // Repeating the redrive while it is under way changes nothing.
    let cmds = s.input(Input::Redrive {
        entry_id: entry0(),
        offset: 0,
    });
    assert!(effects(&cmds).is_empty());

    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    let u = updates(&cmds);
    assert_eq!(
        (u[0].offset, u[0].state),
        (0, DeliveryState::AckedAwaitingCommit)
    );
    assert!(cmds.contains(&Command::RedriveSucceeded {
        entry_id: entry0(),
        offset: 0
    }));
    assert!(resolves(&cmds).is_empty());
    assert_eq!(s.core.committed(), 1, "the committed offset is not touched");

    // Meta is down: held, asked again later.
    s.input(Input::RedriveUnavailable { offset: 0 });
    s.advance(100);
    let cmds = s.tick();
    assert!(cmds.contains(&Command::RedriveSucceeded {
        entry_id: entry0(),
        offset: 0
    }));
    let cmds = s.input(Input::RedriveSettled { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], None)]);
    assert_eq!(s.core.stats().redrives, 0);
    assert_eq!(s.core.committed(), 1);
}

#[test]
fn given_a_redriven_event_failing_max_attempts_again_then_redrive_failed() {
    let mut s = dead_lettered_offset_0();
    s.input(Input::Redrive {
        entry_id: entry0(),
        offset: 0,
    });
    let mut last = Vec::new();
    for attempt in 1..=2 {
        let d = s.deliver(1).remove(0);
        assert_eq!((d.offset, d.attempt), (0, attempt));
        last = s.nack(&[&d.delivery_id], "still broken");
        s.advance(1000);
    }
    assert_eq!(nack_outcomes(&last), [NackOutcome::DeadLettering]);
    assert!(last.contains(&Command::RedriveFailed {
        entry_id: entry0(),
        offset: 0,
        reason: "still broken".into(),
        attempts: 2
    }));
    assert!(
        dead_letters(&last).is_empty(),
        "not a second dead-letter entry"
    );
    let cmds = s.input(Input::RedriveSettled { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], None)]);
    assert_eq!(s.core.committed(), 1);
}

#[test]
fn given_a_redrive_that_does_not_fit_then_it_is_refused() {
    let mut s = dead_lettered_offset_0();
    assert_eq!(
        s.core.handle(
            Input::Redrive {
                entry_id: partition().dead_letter_id(1),
                offset: 1
            },
            s.now
        ),
        Err(CoreError::RedriveOfUnresolvedOffset {
            offset: 1,
            committed: 1
        })
    );
    let err = s
        .core
        .handle(
            Input::Redrive {
                entry_id: "someone-elses".into(),
                offset: 0,
            },
            s.now,
        )
        .unwrap_err();
    assert!(matches!(err, CoreError::ForeignDeadLetterEntry { .. }));
    assert_eq!(s.core.stats().redrives, 0);
}

#[test]
fn given_recovered_redrive_records_then_each_redrive_carries_on() {
    // Committed 10: records below it are redrives.
    let p = partition();
    let mut acked = record(1, 1, DeliveryState::AckedAwaitingCommit, u64::MAX);
    acked.delivery_id = "x".into();
    let records = vec![
        acked,
        record(2, 2, DeliveryState::DeadLettering, T0),
        record(3, 1, DeliveryState::InFlight, T0 + 50),
    ];
    let (mut s, cmds) = Shell::recovered(config(), 10, records, T0, 10);
    assert!(cmds.contains(&Command::RedriveSucceeded {
        entry_id: p.dead_letter_id(1),
        offset: 1
    }));
    assert!(cmds.contains(&Command::RedriveFailed {
        entry_id: p.dead_letter_id(2),
        offset: 2,
        reason: "boom".into(),
        attempts: 2
    }));
    assert_eq!(s.core.stats().redrives, 3);
    s.at(T0 + 50);
    let d = s.deliver(5);
    assert_eq!((d[0].offset, d[0].attempt), (3, 2));
    assert_eq!(d[0].redrive_of, Some(p.dead_letter_id(3)));
    assert_eq!(s.core.committed(), 10);
}

// ---- time, reads, misuse -----------------------------------------------------------

#[test]
fn given_timers_then_next_wakeup_names_the_earliest_one() {
    let mut s = Shell::new(config(), 0);
    assert_eq!(s.core.next_wakeup(), None);
    s.publish(2);
    assert_eq!(s.core.next_wakeup(), None, "pending events are not timers");
    assert_eq!(s.core.ready(s.now), 2);
    let recs = s.pull(1);
    assert_eq!(s.core.next_wakeup(), None, "persisting: no lease yet");
    s.persisted(&recs);
    assert_eq!(s.core.next_wakeup(), Some(T0 + 1000));
    s.advance(10);
    let d1 = s.deliver(1).remove(0);
    assert_eq!(s.core.next_wakeup(), Some(T0 + 1000));
    s.nack(&[&d1.delivery_id], "x"); // due at T0 + 10 + 100
    assert_eq!(s.core.next_wakeup(), Some(T0 + 110));
    s.at(T0 + 110);
    s.tick();
    // The retry is due now: it waits for a pull, it is no wake-up.
    assert_eq!(s.core.next_wakeup(), Some(T0 + 1000));
    assert_eq!(s.core.ready(s.now), 1);
    s.at(T0 + 1000);
    s.tick();
    // Offset 0's lease ended -> its retry is due at T0 + 1100.
    assert_eq!(s.core.next_wakeup(), Some(T0 + 1100));
}

#[test]
fn given_a_failed_read_then_the_core_asks_again_after_read_retry_ms() {
    let mut s = Shell::new(config(), 0);
    s.log.extend((0..3).map(event));
    let cmds = s.raw(Input::LogEnd(3));
    assert_eq!(reads(&cmds), [(0, 3)]);
    let cmds = s.raw(Input::ReadFailed);
    assert!(reads(&cmds).is_empty());
    assert_eq!(s.core.next_wakeup(), Some(T0 + 500));
    s.advance(500);
    let cmds = s.raw(Input::Tick);
    assert_eq!(reads(&cmds), [(0, 3)]);
    // A short answer: the core reads on from where it ended.
    let cmds = s.raw(Input::EventsRead(vec![event(0)]));
    assert_eq!(reads(&cmds), [(1, 2)]);
    // An empty answer: nothing there after all; no busy loop of reads.
    let cmds = s.raw(Input::EventsRead(vec![]));
    assert!(reads(&cmds).is_empty());
    assert_eq!(s.core.stats().log_end, 1);
    let cmds = s.raw(Input::LogEnd(3));
    assert_eq!(reads(&cmds), [(1, 2)]);
}

#[test]
fn given_misuse_then_typed_errors_and_no_state_change() {
    let mut s = Shell::new(config(), 0);
    s.publish(2);
    let before = s.core.stats();
    let now = s.now;
    let cases = [
        (Input::EventsRead(vec![event(0)]), "no read"),
        (Input::ReadFailed, "no read"),
        (
            Input::Pull {
                pull_id: meshd_dispatch::PullId(1),
                max_events: 0,
                max_bytes: u64::MAX,
                at_least_one: true,
                session: None,
            },
            "at least 1",
        ),
        (
            Input::AttemptPersisted {
                offset: 0,
                attempt: 1,
            },
            "not being persisted",
        ),
        (
            Input::PersistFailed {
                offset: 9,
                attempt: 1,
            },
            "not being persisted",
        ),
        (Input::DeadLettered { offset: 0 }, "no dead-letter"),
        (Input::DeadLetterUnavailable { offset: 0 }, "no dead-letter"),
        (Input::RedriveSettled { offset: 0 }, "no redrive"),
        (Input::RedriveUnavailable { offset: 0 }, "no redrive"),
    ];
    for (input, want) in cases {
        let err = s.core.handle(input, now).unwrap_err();
        assert!(err.to_string().contains(want), "{err}");
        assert_eq!(s.core.stats(), before);
    }
    // A read answer that does not fit the outstanding read.
    let mut s = Shell::new(config(), 0);
    s.log.extend((0..3).map(event));
    s.raw(Input::LogEnd(3));
    for bad in [
        vec![event(1)],
        vec![event(0), event(2)],
        vec![event(0), event(1), event(2), event(3)],
    ] {
        assert!(matches!(
            s.core.handle(Input::EventsRead(bad), s.now),
            Err(CoreError::ReadMismatch { .. })
        ));
    }
    // and the right one still works afterwards
    assert!(s
        .core
        .handle(Input::EventsRead(vec![event(0), event(1), event(2)]), s.now)
        .is_ok());
}

#[test]
fn given_a_clock_that_goes_backwards_then_the_core_keeps_its_latest_time() {
    let mut s = Shell::new(config(), 0);
    s.publish(1);
    let d = s.deliver(1).remove(0);
    s.advance(2000);
    s.tick(); // lease ended at T0 + 1000; retry due at T0 + 2100
    s.at(T0); // backwards
    let cmds = s.nack(&[&d.delivery_id], "x");
    assert_eq!(
        nack_outcomes(&cmds),
        [NackOutcome::Retrying {
            due_ms: T0 + 2000 + 100
        }]
    );
}

#[test]
fn given_an_invalid_config_then_new_refuses_it_naming_the_field() {
    type Mutate = fn(&mut meshd_dispatch::Config);
    let cases: [(Mutate, &str); 5] = [
        (|c| c.max_attempts = 0, "max_attempts"),
        (|c| c.ack_timeout_ms = 10, "ack_timeout_ms"),
        (
            |c| {
                c.backoff = Backoff {
                    initial_ms: 10,
                    max_ms: 5,
                }
            },
            "backoff",
        ),
        (|c| c.max_in_flight = 0, "max_in_flight"),
        (|c| c.max_window = 0, "max_window"),
    ];
    for (mutate, field) in cases {
        let mut cfg = config();
        mutate(&mut cfg);
        let err = PartitionCore::new(
            Partition {
                key: key(),
                log_id: "i".into(),
                owner_epoch: 0,
                reset_epoch: 0,
            },
            cfg,
            0,
            Sources::production(meshd_dispatch::IdKey::random()),
        )
        .err()
        .expect("refused");
        assert!(err.to_string().contains(field), "{err}");
    }
    assert!(meshd_dispatch::Config::default().validate().is_ok());
}

// ---- moves: inherited leases and authenticated ids ----------------------------------

/// A core with MAC'd ids under `key` (as production builds them), reset epoch
/// `reset_epoch`, recovered from `records` at `now`.
fn mac_core(
    id_key: &meshd_dispatch::IdKey,
    reset_epoch: u64,
    records: Vec<DeliveryRecord>,
    now: u64,
) -> PartitionCore {
    let (core, _) = PartitionCore::recover(
        Partition {
            reset_epoch,
            ..partition()
        },
        config(),
        0,
        records,
        &Default::default(),
        now,
        Sources {
            ids: Box::new(meshd_dispatch::MacIds::new(id_key.clone())),
            jitter: Box::new(FixedJitter::Max),
        },
    )
    .expect("recover");
    core
}

/// What the ledger gives a new owner: no id, the previous owner's deadline.
fn inherited(
    offset: u64,
    attempt: u32,
    deadline_ms: u64,
    session: Option<SessionBinding>,
) -> DeliveryRecord {
    DeliveryRecord {
        delivery_id: String::new(),
        last_reason: None,
        session,
        ..record(offset, attempt, DeliveryState::InFlight, deadline_ms)
    }
}

#[test]
fn given_a_partition_moved_with_a_delivery_in_flight_then_the_new_owner_honours_its_id_until_its_deadline(
) {
    let id_key = meshd_dispatch::IdKey::from_secret(b"cluster secret");
    // The first owner hands offset 0 out (attempt 1) and 1 to a session.
    let mut a = mac_core(&id_key, 0, vec![], T0);
    let ack = |core: &mut PartitionCore, id: &str, now: u64| {
        let cmds = core
            .handle(Input::Ack(vec![DeliveryRef::unbound(id)]), now)
            .unwrap();
        ack_outcomes(&cmds)
    };
    let mut ids = Vec::new();
    let cmds = a.handle(Input::LogEnd(2), T0).unwrap();
    let read = reads(&cmds);
    assert_eq!(read, vec![(0, 2)]);
    a.handle(Input::EventsRead(vec![event(0), event(1)]), T0)
        .unwrap();
    for (offset, session) in [(0, None), (1, Some(session(4)))] {
        let cmds = a
            .handle(
                Input::Pull {
                    pull_id: meshd_dispatch::PullId(offset + 1),
                    max_events: 1,
                    max_bytes: u64::MAX,
                    at_least_one: true,
                    session,
                },
                T0,
            )
            .unwrap();
        let r = persists(&cmds).remove(0);
        let cmds = a
            .handle(
                Input::AttemptPersisted {
                    offset: r.offset,
                    attempt: r.attempt,
                },
                T0,
            )
            .unwrap();
        ids.push(handouts(&cmds).remove(0));
    }
    let deadline = T0 + 1000;
    assert_eq!(ids[0].deadline_ms, deadline);

    // The new owner inherits both from the ledger (attempt, deadline, session) and
    // rebuilds the same ids: the consumer's ack is honoured there, not `unknown`.
    let mut b = mac_core(
        &id_key,
        0,
        vec![
            inherited(0, 1, deadline, None),
            inherited(1, 1, deadline, Some(session(4))),
        ],
        T0 + 500,
    );
    assert_eq!(
        b.stats().in_flight,
        2,
        "still in flight: no redelivery at once"
    );
    assert_eq!(b.bound_session(&ids[1].delivery_id), Some(&session(4)));
    assert_eq!(
        ack(&mut b, &ids[0].delivery_id, T0 + 600),
        vec![AckOutcome::Acked]
    );

    // An id forged with another key, or of another reset epoch, is no id here.
    for (key, reset) in [
        (meshd_dispatch::IdKey::from_secret(b"another secret"), 0),
        (id_key.clone(), 1),
    ] {
        let mut c = mac_core(&key, reset, vec![inherited(0, 1, deadline, None)], T0 + 500);
        assert_eq!(
            ack(&mut c, &ids[0].delivery_id, T0 + 600),
            vec![AckOutcome::Unknown]
        );
    }
    // A stale attempt stays unknown: once the lease passed, attempt 2 is current.
    let mut d = mac_core(&id_key, 0, vec![inherited(0, 1, deadline, None)], T0 + 500);
    let cmds = d
        .handle(
            Input::Pull {
                pull_id: meshd_dispatch::PullId(9),
                max_events: 1,
                max_bytes: u64::MAX,
                at_least_one: true,
                session: None,
            },
            deadline + 1,
        )
        .unwrap();
    let again = persists(&cmds);
    assert_eq!(
        again
            .iter()
            .map(|r| (r.offset, r.attempt))
            .collect::<Vec<_>>(),
        vec![(0, 2)],
        "redelivered when the inherited lease ended, with the next attempt"
    );
    assert_eq!(
        ack(&mut d, &ids[0].delivery_id, deadline + 2),
        vec![AckOutcome::Unknown]
    );
}

// ---- parking (deliverat) -----------------------------------------------------------

fn parks(cmds: &[Command]) -> Vec<(u64, u64)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Park { offset, due_ms, .. } => Some((*offset, *due_ms)),
            _ => None,
        })
        .collect()
}

#[test]
fn given_an_event_with_a_later_deliverat_then_it_is_parked_resolved_and_later_offsets_flow() {
    let mut s = Shell::new(config(), 0);
    let due = T0 + 7 * 86_400_000;
    // A later time parks; a past one (or none) is delivered at once.
    let cmds = s.publish_delayed(&[Some(due), Some(T0 - 1), None]);
    assert_eq!(parks(&cmds), [(0, due)]);
    let stats = s.core.stats();
    assert_eq!((stats.parking, stats.outstanding), (1, 0), "{stats:?}");
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [1, 2], "the parked event is not handed out");
    // Until the park entry is durable the offset holds `committed`.
    let cmds = s.ack(&[&d[0].delivery_id, &d[1].delivery_id]);
    assert_eq!(s.core.stats().committed, 0);
    assert!(
        resolves(&cmds).iter().all(|(_, adv)| adv.is_none()),
        "{cmds:?}"
    );
    // Then it counts as resolved: committed passes it and the acks above it.
    let cmds = s.input(Input::Parked { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![1, 2], Some(3))]);
    let stats = s.core.stats();
    assert_eq!(
        (stats.parking, stats.outstanding, stats.committed),
        (0, 0, 3)
    );
    s.core.check_consistency().unwrap();
}

#[test]
fn given_a_parked_event_when_due_then_it_is_delivered_below_committed_and_its_ack_settles_the_park_entry(
) {
    let mut s = Shell::new(config(), 0);
    let due = T0 + 60_000;
    s.publish_delayed(&[Some(due)]);
    s.input(Input::Parked { offset: 0 });
    assert_eq!(s.core.stats().committed, 1);
    s.at(due);
    s.input(Input::Unpark {
        offset: 0,
        attempt: 0,
    });
    let d = s.deliver(1);
    assert_eq!(offsets(&d), [0]);
    assert!(d[0].parked && d[0].redrive_of.is_none(), "{d:?}");
    assert_eq!(d[0].attempt, 1);
    // Feeding the same due entry again while it is under way changes nothing.
    let cmds = s.input(Input::Unpark {
        offset: 0,
        attempt: 0,
    });
    assert!(effects(&cmds).is_empty(), "{cmds:?}");
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    assert!(
        cmds.contains(&Command::ParkSettled { offset: 0 }),
        "{cmds:?}"
    );
    assert!(
        !cmds
            .iter()
            .any(|c| matches!(c, Command::RedriveSucceeded { .. })),
        "{cmds:?}"
    );
    let cmds = s.input(Input::RedriveSettled { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], None)], "the record goes");
    let stats = s.core.stats();
    assert_eq!((stats.redrives, stats.committed), (0, 1));
    s.core.check_consistency().unwrap();
}

#[test]
fn given_a_parked_event_due_while_an_earlier_offset_holds_committed_then_it_is_delivered_from_the_window_at_its_time(
) {
    let mut cfg = config();
    cfg.ack_timeout_ms = 120_000;
    let mut s = Shell::new(cfg, 0);
    let due = T0 + 60_000;
    s.publish_delayed(&[None, Some(due), None]);
    s.input(Input::Parked { offset: 1 });
    // Offset 0 stays in flight (a slow consumer): committed stays below the parked one.
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 2]);
    let held = d[0].clone();
    s.ack(&[&d[1].delivery_id]);
    assert_eq!(s.core.stats().committed, 0);
    s.at(due);
    let cmds = s.input(Input::Unpark {
        offset: 1,
        attempt: 0,
    });
    assert!(effects(&cmds).is_empty(), "{cmds:?}");
    assert!(s.core.is_unparked(1));
    let d = s.deliver(10);
    assert_eq!(
        offsets(&d),
        [1],
        "delivered at its time, not after offset 0"
    );
    assert!(d[0].parked && d[0].redrive_of.is_none(), "{d:?}");
    assert_eq!(d[0].attempt, 1);
    // Until its park entry is settled it holds committed like any window entry.
    let cmds = s.ack(&[&held.delivery_id]);
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))]);
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(ack_outcomes(&cmds), [AckOutcome::Acked]);
    assert!(
        cmds.contains(&Command::ParkSettled { offset: 1 }),
        "{cmds:?}"
    );
    assert_eq!(s.core.stats().committed, 1);
    let cmds = s.input(Input::RedriveSettled { offset: 1 });
    assert_eq!(
        resolves(&cmds),
        [(vec![1, 2], Some(3))],
        "settled: committed passes it and the acks above it, records and all"
    );
    assert!(!s.core.is_unparked(1));
    s.core.check_consistency().unwrap();
}

#[test]
fn given_a_crash_then_records_tell_events_unparked_in_the_window_from_parked_retries() {
    // Offset 0 holds committed (in flight). Offset 1 was unparked in the window and
    // acked (attempt 1; its park entry, parked as read, says 0), its settlement not
    // written yet. Offset 2 is a retry parked with its 2 attempts: its record was
    // marked acked with those 2. Offset 3 was unparked in the window and is in flight.
    let records = vec![
        record(0, 1, DeliveryState::InFlight, T0 + 30_000),
        record(1, 1, DeliveryState::AckedAwaitingCommit, u64::MAX),
        record(2, 2, DeliveryState::AckedAwaitingCommit, u64::MAX),
        record(3, 1, DeliveryState::InFlight, T0 + 5_000),
    ];
    let parked = std::collections::BTreeMap::from([(1, 0), (2, 2), (3, 0)]);
    let (mut s, cmds) = Shell::recovered_parked(config(), 0, records, &parked, T0, 4);
    assert!(
        cmds.contains(&Command::ParkSettled { offset: 1 }),
        "the accepted ack is settled, not delivered again: {cmds:?}"
    );
    assert!(
        !cmds.contains(&Command::ParkSettled { offset: 2 }),
        "the parked retry stays parked: {cmds:?}"
    );
    assert!(s.core.is_unparked(1) && !s.core.is_unparked(2) && s.core.is_unparked(3));
    s.core.check_consistency().unwrap();
    // The parked retry is unparked in the window when due, its count continuing.
    let cmds = s.input(Input::Unpark {
        offset: 2,
        attempt: 2,
    });
    assert!(effects(&cmds).is_empty(), "{cmds:?}");
    let d = s.deliver(10);
    assert_eq!(
        d.iter()
            .map(|d| (d.offset, d.attempt, d.parked))
            .collect::<Vec<_>>(),
        [(2, 3, true)],
        "offsets 0 and 3 are still leased; offset 1 is never handed out again"
    );
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert!(
        cmds.contains(&Command::ParkSettled { offset: 2 }),
        "{cmds:?}"
    );
    s.input(Input::RedriveSettled { offset: 1 });
    assert_eq!(s.core.stats().committed, 0);
    // The one in flight keeps its lease, then comes again with its next attempt.
    s.at(T0 + 5_000);
    let d = s.deliver(10);
    assert_eq!(
        d.iter()
            .map(|d| (d.offset, d.attempt, d.parked))
            .collect::<Vec<_>>(),
        [(3, 2, true)]
    );
    s.core.check_consistency().unwrap();
}

#[test]
fn given_a_retry_due_beyond_park_retries_after_ms_then_it_is_parked_with_its_attempts_and_committed_passes_it(
) {
    let mut cfg = config();
    cfg.park_retries_after_ms = Some(30_000);
    let mut s = Shell::new(cfg, 0);
    s.publish(2);
    let first = s.deliver(1).remove(0);
    let nack = |s: &mut Shell, id: &str, delay_ms| {
        s.input(Input::Nack {
            deliveries: vec![DeliveryRef::unbound(id)],
            reason: "tomorrow".into(),
            delay_ms: Some(delay_ms),
        })
    };
    // Below the threshold a retry waits (holding committed), as before.
    let cmds = nack(&mut s, &first.delivery_id, 29_999);
    assert!(parks(&cmds).is_empty(), "{cmds:?}");
    s.at(s.now + 29_999);
    let first = s.deliver(1).remove(0);
    assert_eq!((first.offset, first.attempt), (0, 2));
    // At the threshold it is parked with the attempts made so far, not a waiting retry.
    let cmds = nack(&mut s, &first.delivery_id, 60_000);
    let due = s.now + 60_000;
    assert_eq!(
        nack_outcomes(&cmds),
        [NackOutcome::Retrying { due_ms: due }]
    );
    assert!(
        cmds.contains(&Command::Park {
            offset: 0,
            due_ms: due,
            attempt: 2,
            key: None,
            not_before_ms: 0,
        }),
        "{cmds:?}"
    );
    assert!(
        updates(&cmds).is_empty(),
        "no waiting-retry record: {cmds:?}"
    );
    // It keeps its max_in_flight slot until the park entry is durable (its record
    // still says in flight).
    let stats = s.core.stats();
    assert_eq!((stats.parking, stats.outstanding, stats.waiting), (1, 1, 0));
    // Its last id is no longer current.
    assert_eq!(
        ack_outcomes(&s.ack(&[&first.delivery_id])),
        [AckOutcome::Unknown]
    );
    let later = s.deliver(1).remove(0);
    assert_eq!(later.offset, 1);
    s.ack(&[&later.delivery_id]);
    assert_eq!(
        s.core.stats().committed,
        0,
        "held until the park entry is durable"
    );
    // Parked: committed passes it, and its record goes with the advance.
    let cmds = s.input(Input::Parked { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0, 1], Some(2))]);
    assert_eq!(s.core.stats().outstanding, 0);
    // Due: unparked with its attempts, the count continues.
    s.at(due);
    s.input(Input::Unpark {
        offset: 0,
        attempt: 2,
    });
    let d = s.deliver(1);
    assert_eq!((d[0].offset, d[0].attempt, d[0].parked), (0, 3, true));
    let cmds = s.nack(&[&d[0].delivery_id], "never");
    assert_eq!(nack_outcomes(&cmds), [NackOutcome::DeadLettering]);
    assert!(
        cmds.iter()
            .any(|c| matches!(c, Command::ParkDeadLetter(r) if r.offset == 0 && r.attempts == 3)),
        "{cmds:?}"
    );
    s.core.check_consistency().unwrap();
}

#[test]
fn given_a_record_of_a_parked_retry_when_recovered_then_the_park_entry_wins_and_committed_passes_it(
) {
    let mut cfg = config();
    cfg.park_retries_after_ms = Some(30_000);
    // The crash came after the park entry was durable and before the advance: the
    // record still says in flight.
    let record = DeliveryRecord {
        key: key(),
        offset: 0,
        attempt: 2,
        delivery_id: "old".into(),
        deadline_ms: T0 + 1000,
        last_reason: None,
        first_delivered_at_ms: T0,
        state: DeliveryState::InFlight,
        owner_epoch: 11,
        session: None,
    };
    let parked: std::collections::BTreeMap<u64, u32> = [(0, 2)].into();
    let (core, cmds) = PartitionCore::recover(
        partition(),
        cfg,
        0,
        vec![record],
        &parked,
        T0,
        Sources::deterministic(0, RngJitter::seeded(0)),
    )
    .unwrap();
    assert_eq!(resolves(&cmds), [(vec![0], Some(1))], "{cmds:?}");
    let stats = core.stats();
    assert_eq!((stats.committed, stats.in_flight, stats.waiting), (1, 0, 0));
    core.check_consistency().unwrap();
}

#[test]
fn given_a_parked_retry_with_more_attempts_than_a_lowered_max_attempts_when_due_then_it_is_dead_lettered(
) {
    let mut cfg = config();
    cfg.max_attempts = 2;
    let mut s = Shell::new(cfg, 0);
    s.publish(1);
    let d = s.deliver(1);
    s.ack(&[&d[0].delivery_id]);
    assert_eq!(s.core.stats().committed, 1);
    // Parked after 3 attempts while max_attempts was higher; now it is 2.
    let cmds = s.input(Input::Unpark {
        offset: 0,
        attempt: 3,
    });
    let requests: Vec<_> = cmds
        .iter()
        .filter_map(|c| match c {
            Command::ParkDeadLetter(r) => Some(r.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(requests.len(), 1, "{cmds:?}");
    assert_eq!((requests[0].offset, requests[0].attempts), (0, 3));
    assert!(
        requests[0].reason.contains("max_attempts lowered"),
        "{:?}",
        requests[0].reason
    );
    assert!(s.pull(1).is_empty(), "never delivered");
    s.input(Input::RedriveSettled { offset: 0 });
    assert_eq!(s.core.stats().redrives, 0);
    s.core.check_consistency().unwrap();
}

#[test]
fn given_an_unparked_event_that_fails_max_attempts_then_it_is_dead_lettered_from_its_park_entry() {
    let mut cfg = config();
    cfg.max_attempts = 2;
    let mut s = Shell::new(cfg, 0);
    s.publish_delayed(&[Some(T0 + 1000)]);
    s.input(Input::Parked { offset: 0 });
    s.at(T0 + 1000);
    s.input(Input::Unpark {
        offset: 0,
        attempt: 0,
    });
    let d = s.deliver(1);
    let cmds = s.nack(&[&d[0].delivery_id], "not yet");
    let [NackOutcome::Retrying { due_ms }] = nack_outcomes(&cmds)[..] else {
        panic!("{cmds:?}")
    };
    s.at(due_ms);
    let d = s.deliver(1);
    assert_eq!((d[0].offset, d[0].attempt, d[0].parked), (0, 2, true));
    let cmds = s.nack(&[&d[0].delivery_id], "still not");
    assert_eq!(nack_outcomes(&cmds), [NackOutcome::DeadLettering]);
    let requests: Vec<_> = cmds
        .iter()
        .filter_map(|c| match c {
            Command::ParkDeadLetter(r) => Some(r.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(requests.len(), 1, "{cmds:?}");
    assert_eq!(
        (
            requests[0].offset,
            requests[0].attempts,
            requests[0].reason.as_str()
        ),
        (0, 2, "still not")
    );
    assert!(
        dead_letters(&cmds).is_empty(),
        "not the window's dead-letter write"
    );
    // Held until the write is durable; a failed write is asked again after a backoff.
    let cmds = s.input(Input::RedriveUnavailable { offset: 0 });
    assert!(effects(&cmds).is_empty(), "{cmds:?}");
    s.advance(10_000);
    let cmds = s.input(Input::Tick);
    assert_eq!(
        cmds.iter()
            .filter(|c| matches!(c, Command::ParkDeadLetter(_)))
            .count(),
        1,
        "{cmds:?}"
    );
    let cmds = s.input(Input::RedriveSettled { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], None)]);
    assert_eq!(s.core.stats().redrives, 0);
    s.core.check_consistency().unwrap();
}

#[test]
fn given_a_crash_with_an_unparked_event_in_flight_then_recovery_finds_it_by_the_park_index() {
    // Offset 0 was unparked and handed out (attempt 1) below committed 2; offset 1 is a
    // dead-letter redrive. The park index holds offset 0.
    let records = vec![
        record(0, 1, DeliveryState::InFlight, T0 - 1),
        record(1, 1, DeliveryState::InFlight, T0 - 1),
    ];
    let parked = std::collections::BTreeMap::from([(0, 0)]);
    let (mut s, _) = Shell::recovered_parked(config(), 2, records, &parked, T0, 2);
    s.core.check_consistency().unwrap();
    let d = s.deliver(10);
    let got: Vec<_> = d
        .iter()
        .map(|d| (d.offset, d.attempt, d.parked, d.redrive_of.is_some()))
        .collect();
    assert_eq!(got, [(0, 2, true, false), (1, 2, false, true)]);
    let cmds = s.ack(&[&d[0].delivery_id, &d[1].delivery_id]);
    assert!(
        cmds.contains(&Command::ParkSettled { offset: 0 }),
        "{cmds:?}"
    );
    assert!(
        cmds.iter()
            .any(|c| matches!(c, Command::RedriveSucceeded { offset: 1, .. })),
        "{cmds:?}"
    );
}

#[test]
fn parking_inputs_that_do_not_fit_the_state_are_refused() {
    let mut s = Shell::new(config(), 0);
    s.publish_delayed(&[None, Some(T0 + 1000)]);
    let err = s.core.handle(Input::Parked { offset: 0 }, T0).unwrap_err();
    assert!(matches!(err, CoreError::NotParking { offset: 0 }), "{err}");
    let err = s
        .core
        .handle(
            Input::Unpark {
                offset: 1,
                attempt: 0,
            },
            T0,
        )
        .unwrap_err();
    assert!(
        matches!(err, CoreError::RedriveOfUnresolvedOffset { offset: 1, .. }),
        "{err}"
    );
    // Resolve 0 and park 1: committed 2. A dead-letter redrive of the unparked offset
    // (or an unpark of a redriven one) is refused.
    let d = s.deliver(1);
    s.ack(&[&d[0].delivery_id]);
    s.input(Input::Parked { offset: 1 });
    s.input(Input::Unpark {
        offset: 1,
        attempt: 0,
    });
    let err = s
        .core
        .handle(
            Input::Redrive {
                entry_id: s.core.partition().dead_letter_id(1),
                offset: 1,
            },
            T0,
        )
        .unwrap_err();
    assert!(
        matches!(err, CoreError::RedriveOfParked { offset: 1 }),
        "{err}"
    );
    s.input(Input::Redrive {
        entry_id: s.core.partition().dead_letter_id(0),
        offset: 0,
    });
    let err = s
        .core
        .handle(
            Input::Unpark {
                offset: 0,
                attempt: 0,
            },
            T0,
        )
        .unwrap_err();
    assert!(
        matches!(err, CoreError::UnparkOfRedrive { offset: 0 }),
        "{err}"
    );
}

// ---- ordered delivery per key -------------------------------------------------------

fn ordered() -> Config {
    Config {
        ordered: true,
        ..config()
    }
}

/// Appends events with these ordering keys (`None`: no `partitionkey`), the park index
/// holding none of them, and tells the core the new end.
fn publish_keyed(s: &mut Shell, keys: &[Option<u64>]) -> Vec<Command> {
    for key in keys {
        let offset = s.log.len() as u64;
        s.log.push(EventMeta {
            key: *key,
            ..event(offset)
        });
    }
    s.input(Input::LogEnd(s.log.len() as u64))
}

/// (offset, key, held) of each `Park`.
fn keyed_parks(cmds: &[Command]) -> Vec<(u64, Option<u64>, bool)> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::Park {
                offset,
                due_ms,
                key,
                ..
            } => Some((*offset, *key, *due_ms == HELD)),
            _ => None,
        })
        .collect()
}

fn releases(cmds: &[Command]) -> Vec<u64> {
    cmds.iter()
        .filter_map(|c| match c {
            Command::ReleaseKey { key } => Some(*key),
            _ => None,
        })
        .collect()
}

#[test]
fn given_an_ordered_subscription_then_a_key_s_later_events_park_behind_it_and_other_keys_flow() {
    let mut s = Shell::new(ordered(), 0);
    // Key 7 twice, key 8, no key, key 7 again.
    let cmds = publish_keyed(&mut s, &[Some(7), Some(7), Some(8), None, Some(7)]);
    assert_eq!(
        keyed_parks(&cmds),
        [(1, Some(7), true), (4, Some(7), true)],
        "the later events of key 7 are held behind offset 0"
    );
    for o in [1, 4] {
        s.input(Input::Parked { offset: o });
    }
    let d = s.deliver(10);
    assert_eq!(offsets(&d), [0, 2, 3], "other keys (and no key) flow");
    // Acking key 8 and the keyless event frees nothing of key 7.
    let cmds = s.ack(&[&d[1].delivery_id, &d[2].delivery_id]);
    assert_eq!(releases(&cmds), [8]);
    // Committed stays at 0 (key 7's first event is out), not at a held event.
    assert_eq!(s.core.stats().committed, 0);
    // Its ack releases the key: after the resolving write, never before.
    let cmds = s.ack(&[&d[0].delivery_id]);
    assert_eq!(releases(&cmds), [7]);
    let at_resolve = cmds
        .iter()
        .position(|c| matches!(c, Command::Resolve { .. }))
        .unwrap();
    let at_release = cmds
        .iter()
        .position(|c| matches!(c, Command::ReleaseKey { .. }))
        .unwrap();
    assert!(at_resolve < at_release, "{cmds:?}");
    assert_eq!(s.core.stats().committed, 5, "held events count as resolved");
    s.core.check_consistency().unwrap();
}

#[test]
fn given_an_ordered_key_when_its_event_is_nacked_retried_or_dead_lettering_then_the_key_stays_held()
{
    let mut s = Shell::new(
        Config {
            max_attempts: 2,
            ..ordered()
        },
        0,
    );
    publish_keyed(&mut s, &[Some(7)]);
    let d = s.deliver(1);
    // A nack: waiting for its retry, the key is held; a new event of it parks.
    let cmds = s.nack(&[&d[0].delivery_id], "boom");
    assert!(releases(&cmds).is_empty(), "{cmds:?}");
    let cmds = publish_keyed(&mut s, &[Some(7)]);
    assert_eq!(keyed_parks(&cmds), [(1, Some(7), true)]);
    s.input(Input::Parked { offset: 1 });
    // The retry fails too: dead-lettering still holds the key ...
    s.advance(1000);
    let d = s.deliver(1);
    assert_eq!((d[0].offset, d[0].attempt), (0, 2));
    let cmds = s.nack(&[&d[0].delivery_id], "boom");
    assert!(releases(&cmds).is_empty(), "{cmds:?}");
    assert!(cmds.iter().any(|c| matches!(c, Command::DeadLetter(_))));
    let cmds = s.input(Input::DeadLetterUnavailable { offset: 0 });
    assert!(releases(&cmds).is_empty(), "{cmds:?}");
    s.advance(1000);
    let cmds = s.tick();
    assert!(cmds.iter().any(|c| matches!(c, Command::DeadLetter(_))));
    assert!(releases(&cmds).is_empty(), "{cmds:?}");
    // ... until the dead-letter entry is durable.
    let cmds = s.input(Input::DeadLettered { offset: 0 });
    assert_eq!(releases(&cmds), [7]);
    s.core.check_consistency().unwrap();
}

#[test]
fn given_an_ordered_key_parked_in_the_index_when_read_then_the_event_parks_behind_it_with_its_deliverat(
) {
    let mut s = Shell::new(ordered(), 0);
    let later = T0 + 60_000;
    s.log.push(EventMeta {
        key: Some(7),
        key_parked: true,
        deliver_at_ms: Some(later),
        ..event(0)
    });
    let cmds = s.input(Input::LogEnd(1));
    let park = cmds
        .iter()
        .find(|c| matches!(c, Command::Park { .. }))
        .expect("parked");
    assert_eq!(
        park,
        &Command::Park {
            offset: 0,
            due_ms: HELD,
            attempt: 0,
            key: Some(7),
            not_before_ms: later,
        }
    );
    // Parking frees nothing: the index's first entry of the key holds it.
    let cmds = s.input(Input::Parked { offset: 0 });
    assert_eq!(releases(&cmds), [7], "{cmds:?}");
}

#[test]
fn given_held_keys_after_recovery_then_each_is_released_once_the_recovered_records_are_read_and_none_holds_it(
) {
    // Offset 2 (key 7) is in flight from before the crash; keys 7 and 9 each have a
    // held entry in the park index.
    let record = DeliveryRecord {
        key: key(),
        offset: 2,
        attempt: 1,
        delivery_id: "old".into(),
        deadline_ms: T0 + 5000,
        last_reason: None,
        first_delivered_at_ms: T0,
        state: DeliveryState::InFlight,
        session: None,
        owner_epoch: 11,
    };
    let none = std::collections::BTreeMap::new();
    let (mut s, _) = Shell::recovered_parked(ordered(), 0, vec![record], &none, T0, 0);
    for (o, k) in [(0, Some(1)), (1, None), (2, Some(7))] {
        s.log.push(EventMeta { key: k, ..event(o) });
    }
    let cmds = s.raw(Input::KeysHeld(vec![7, 9]));
    assert!(
        releases(&cmds).is_empty(),
        "keys of the records are not known yet"
    );
    let cmds = s.input(Input::LogEnd(3));
    assert_eq!(
        releases(&cmds),
        [9],
        "key 7 is held by offset 2, read now; key 9 by nobody"
    );
    s.core.check_consistency().unwrap();
}

#[test]
fn given_an_unparked_event_retried_far_ahead_then_it_is_parked_again_after_its_waiting_record_and_leaves_memory(
) {
    let mut cfg = config();
    cfg.park_retries_after_ms = Some(30_000);
    let mut s = Shell::new(cfg, 0);
    let due = T0 + 1000;
    s.publish_delayed(&[Some(due)]);
    s.input(Input::Parked { offset: 0 });
    s.at(due);
    s.input(Input::Unpark {
        offset: 0,
        attempt: 0,
    });
    let d = s.deliver(1);
    assert_eq!((d[0].offset, d[0].attempt, d[0].parked), (0, 1, true));
    let cmds = s.input(Input::Nack {
        deliveries: vec![DeliveryRef::unbound(d[0].delivery_id.clone())],
        reason: "later".into(),
        delay_ms: Some(60_000),
    });
    let again = s.now + 60_000;
    assert_eq!(
        nack_outcomes(&cmds),
        [NackOutcome::Retrying { due_ms: again }]
    );
    // The waiting record first, then the park entry's new time and count.
    let waiting = updates(&cmds);
    assert_eq!(waiting.len(), 1, "{cmds:?}");
    assert_eq!(
        (waiting[0].state, waiting[0].deadline_ms),
        (DeliveryState::WaitingRetry, again)
    );
    let at_update = cmds
        .iter()
        .position(|c| matches!(c, Command::Update(_)))
        .unwrap();
    let at_repark = cmds
        .iter()
        .position(|c| {
            *c == Command::Repark {
                offset: 0,
                due_ms: again,
                attempt: 1,
            }
        })
        .expect("reparked");
    assert!(at_update < at_repark, "{cmds:?}");
    // Once the entry is rewritten, the core lets it go: no slot, no memory.
    let cmds = s.input(Input::RedriveSettled { offset: 0 });
    assert_eq!(resolves(&cmds), [(vec![0], None)]);
    assert_eq!(s.core.stats().redrives, 0);
    assert!(!s.core.is_unparked(0));
    s.core.check_consistency().unwrap();
}
