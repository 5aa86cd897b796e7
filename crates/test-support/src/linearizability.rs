//! Linearizability checking of recorded histories: Wing and Gong's search with Lowe's
//! memoization of (operations linearized, state) pairs, the algorithm Porcupine and
//! Knossos use.
//!
//! Concurrent clients record each call they make ([`Operation`]: when it was sent,
//! when and what it answered, or that it never answered). A history is linearizable
//! when its operations can be put in one order that respects real time (an operation
//! that returned before another was called comes first) and in which every answer is
//! the one a sequential object ([`Model`]) gives. A call that never answered (a
//! timeout, a cut connection, a killed server) may have taken effect at any moment
//! after it was sent, or never.
//!
//! [`check`] searches for such an order; [`check_by_key`] checks each key's history on
//! its own (independent objects, such as one register per subscription name, compose:
//! Herlihy and Wing's locality), which keeps the search small.

use std::collections::{BTreeMap, HashSet};
use std::fmt::Debug;
use std::hash::Hash;

/// A sequential specification of the object the history was recorded against.
pub trait Model {
    type State: Clone + Eq + Hash + Debug;
    type Input: Debug;
    type Output: Debug;

    fn init(&self) -> Self::State;

    /// The state after `input` is applied to `state`, when a sequential object in
    /// `state` could have answered `output`; `None` when it could not. `output` is
    /// `None` for a call that never answered: any answer fits, and the call takes
    /// effect.
    fn step(
        &self,
        state: &Self::State,
        input: &Self::Input,
        output: Option<&Self::Output>,
    ) -> Option<Self::State>;
}

/// One call as a client saw it. Times come from one monotonic clock shared by all
/// clients (nanoseconds since the test began, say).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Operation<I, O> {
    pub client: usize,
    pub input: I,
    /// When the call was sent.
    pub call: u64,
    /// When the answer arrived, and the answer; `None`: no answer ever came.
    pub ret: Option<(u64, O)>,
}

impl<I, O> Operation<I, O> {
    pub fn answered(client: usize, input: I, call: u64, ret: u64, output: O) -> Self {
        Self {
            client,
            input,
            call,
            ret: Some((ret, output)),
        }
    }

    pub fn unanswered(client: usize, input: I, call: u64) -> Self {
        Self {
            client,
            input,
            call,
            ret: None,
        }
    }
}

/// What [`check`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// An order exists; `order` lists the operations (indexes into the history) that
    /// answered, and any unanswered ones that took effect, in that order.
    Linearizable { order: Vec<usize> },
    /// No order exists. `longest` is the longest prefix of an order the search found
    /// (indexes into the history); `stuck` the answered operations that could not
    /// come next after it, one of which must (its answer came before any later one
    /// could be placed).
    NotLinearizable {
        longest: Vec<usize>,
        stuck: Vec<usize>,
    },
    /// The search gave up after `steps` steps without deciding.
    Inconclusive { steps: u64 },
}

impl Verdict {
    pub fn is_linearizable(&self) -> bool {
        matches!(self, Verdict::Linearizable { .. })
    }
}

/// The search's step budget for [`check`]: plenty for histories of a few hundred
/// operations per key with tens of clients.
pub const DEFAULT_MAX_STEPS: u64 = 20_000_000;

/// Whether `history` is linearizable with respect to `model`, with the default
/// budget.
pub fn check<M: Model>(model: &M, history: &[Operation<M::Input, M::Output>]) -> Verdict {
    check_with_budget(model, history, DEFAULT_MAX_STEPS)
}

/// [`check`] for each key's operations on its own (independent objects), in key
/// order; the first verdict that is not linearizable is answered with its key
/// (operation indexes in it are into `history`). `Linearizable`'s order is that of the
/// last key checked.
pub fn check_by_key<M: Model, K: Ord + Clone>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    key: impl Fn(&M::Input) -> K,
) -> Result<(), (K, Verdict)>
where
    M::Input: Clone,
    M::Output: Clone,
{
    let mut by_key: BTreeMap<K, Vec<usize>> = BTreeMap::new();
    for (i, op) in history.iter().enumerate() {
        by_key.entry(key(&op.input)).or_default().push(i);
    }
    for (k, idx) in by_key {
        let sub: Vec<Operation<M::Input, M::Output>> =
            idx.iter().map(|&i| history[i].clone()).collect();
        let map = |v: Vec<usize>| v.into_iter().map(|i| idx[i]).collect();
        match check(model, &sub) {
            Verdict::Linearizable { .. } => {}
            Verdict::NotLinearizable { longest, stuck } => {
                return Err((
                    k,
                    Verdict::NotLinearizable {
                        longest: map(longest),
                        stuck: map(stuck),
                    },
                ))
            }
            v @ Verdict::Inconclusive { .. } => return Err((k, v)),
        }
    }
    Ok(())
}

/// One call or return in time order, in a list operations are lifted out of.
#[derive(Clone, Copy, Debug)]
struct Event {
    op: usize,
    call: bool,
}

/// A doubly linked list over the events, with a sentinel, whose entries can be taken
/// out and put back in reverse order (Knuth's dancing links).
struct Events {
    ev: Vec<Event>,
    next: Vec<usize>,
    prev: Vec<usize>,
    /// Per operation: its call's and return's index in `ev`.
    call_at: Vec<usize>,
    ret_at: Vec<Option<usize>>,
    /// Returns still in the list: the search is done when none is left.
    returns_left: usize,
}

impl Events {
    fn new<I, O>(history: &[Operation<I, O>]) -> Self {
        // (time, calls before returns at one instant: touching calls overlap, the
        // lenient reading, op index) sorted.
        let mut order: Vec<(u64, u8, usize)> = Vec::with_capacity(history.len() * 2);
        for (i, op) in history.iter().enumerate() {
            order.push((op.call, 0, i));
            if let Some((t, _)) = &op.ret {
                order.push((*t, 1, i));
            }
        }
        order.sort_unstable();
        let n = order.len();
        let mut call_at = vec![0; history.len()];
        let mut ret_at = vec![None; history.len()];
        let ev: Vec<Event> = order
            .iter()
            .enumerate()
            .map(|(at, &(_, kind, op))| {
                if kind == 0 {
                    call_at[op] = at;
                } else {
                    ret_at[op] = Some(at);
                }
                Event {
                    op,
                    call: kind == 0,
                }
            })
            .collect();
        // Index n is the head sentinel (and the end: the list is circular).
        let next = (0..=n).map(|i| if i == n { 0 } else { i + 1 }).collect();
        let prev = (0..=n).map(|i| if i == 0 { n } else { i - 1 }).collect();
        let returns_left = ret_at.iter().flatten().count();
        Self {
            ev,
            next,
            prev,
            call_at,
            ret_at,
            returns_left,
        }
    }

    fn head(&self) -> usize {
        self.ev.len()
    }

    fn first(&self) -> usize {
        self.next[self.head()]
    }

    fn unlink(&mut self, x: usize) {
        let (p, n) = (self.prev[x], self.next[x]);
        self.next[p] = n;
        self.prev[n] = p;
    }

    fn relink(&mut self, x: usize) {
        let (p, n) = (self.prev[x], self.next[x]);
        self.next[p] = x;
        self.prev[n] = x;
    }

    /// Takes operation `op` (its call and its return) out of the list.
    fn lift(&mut self, op: usize) {
        self.unlink(self.call_at[op]);
        if let Some(r) = self.ret_at[op] {
            self.unlink(r);
            self.returns_left -= 1;
        }
    }

    /// Puts `op` back (the reverse of the last [`lift`](Self::lift)).
    fn unlift(&mut self, op: usize) {
        if let Some(r) = self.ret_at[op] {
            self.relink(r);
            self.returns_left += 1;
        }
        self.relink(self.call_at[op]);
    }
}

/// [`check`] with a step budget.
pub fn check_with_budget<M: Model>(
    model: &M,
    history: &[Operation<M::Input, M::Output>],
    max_steps: u64,
) -> Verdict {
    let mut events = Events::new(history);
    let words = history.len().div_ceil(64);
    let mut linearized = vec![0u64; words];
    let mut cache: HashSet<(Vec<u64>, M::State)> = HashSet::new();
    let mut state = model.init();
    // The operations lifted, in order, each with the state before it.
    let mut stack: Vec<(usize, M::State)> = Vec::new();
    let mut longest: Vec<usize> = Vec::new();
    let mut stuck: Vec<usize> = Vec::new();
    let mut steps: u64 = 0;
    let mut at = events.first();
    loop {
        if events.returns_left == 0 {
            return Verdict::Linearizable {
                order: stack.iter().map(|(op, _)| *op).collect(),
            };
        }
        steps += 1;
        if steps > max_steps {
            return Verdict::Inconclusive { steps };
        }
        if at != events.head() && events.ev[at].call {
            let op = events.ev[at].op;
            let o = &history[op];
            if let Some(next) = model.step(&state, &o.input, o.ret.as_ref().map(|(_, out)| out)) {
                linearized[op / 64] |= 1 << (op % 64);
                if cache.insert((linearized.clone(), next.clone())) {
                    stack.push((op, std::mem::replace(&mut state, next)));
                    events.lift(op);
                    at = events.first();
                    continue;
                }
                linearized[op / 64] &= !(1 << (op % 64));
            }
            at = events.next[at];
            continue;
        }
        // A return (or the end) before anything else could be placed: the operations
        // lifted so far cannot be a prefix. Note the deepest attempt, then backtrack.
        if stack.len() > longest.len() || longest.is_empty() {
            longest = stack.iter().map(|(op, _)| *op).collect();
            stuck = stuck_after(&events, history);
        }
        let Some((op, before)) = stack.pop() else {
            return Verdict::NotLinearizable { longest, stuck };
        };
        linearized[op / 64] &= !(1 << (op % 64));
        state = before;
        events.unlift(op);
        at = events.next[events.call_at[op]];
    }
}

/// The answered operations whose call is in the list before its first return: the
/// ones one of which had to come next.
fn stuck_after<I, O>(events: &Events, history: &[Operation<I, O>]) -> Vec<usize> {
    let mut out = Vec::new();
    let mut at = events.first();
    while at != events.head() {
        let e = events.ev[at];
        if !e.call {
            break;
        }
        if history[e.op].ret.is_some() {
            out.push(e.op);
        }
        at = events.next[at];
    }
    out
}

/// A register with compare-and-set: the model of a key written by puts and
/// conditional puts (a subscription's settings, a task's state by version).
#[derive(Clone, Copy, Debug, Default)]
pub struct Register;

/// A call on a [`Register`] (`V`: the value type; `None` is absent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterInput<V> {
    Read,
    Write(V),
    /// Writes `new` only when the value is `expect`.
    Cas {
        expect: Option<V>,
        new: V,
    },
    Delete,
}

/// The answer to a [`RegisterInput`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RegisterOutput<V> {
    Read(Option<V>),
    Written,
    /// Whether the compare-and-set wrote.
    Cas(bool),
    /// Whether there was a value to delete.
    Deleted(bool),
}

impl Register {
    /// The register's state after `input`, and the answer it gives.
    fn apply<V: Clone + PartialEq>(
        state: &Option<V>,
        input: &RegisterInput<V>,
    ) -> (Option<V>, RegisterOutput<V>) {
        match input {
            RegisterInput::Read => (state.clone(), RegisterOutput::Read(state.clone())),
            RegisterInput::Write(v) => (Some(v.clone()), RegisterOutput::Written),
            RegisterInput::Cas { expect, new } if expect == state => {
                (Some(new.clone()), RegisterOutput::Cas(true))
            }
            RegisterInput::Cas { .. } => (state.clone(), RegisterOutput::Cas(false)),
            RegisterInput::Delete => (None, RegisterOutput::Deleted(state.is_some())),
        }
    }
}

/// [`Register`] over values of type `V`, starting absent.
#[derive(Clone, Copy, Debug)]
pub struct RegisterOf<V>(std::marker::PhantomData<V>);

impl<V> Default for RegisterOf<V> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<V: Clone + Eq + Hash + Debug> Model for RegisterOf<V> {
    type State = Option<V>;
    type Input = RegisterInput<V>;
    type Output = RegisterOutput<V>;

    fn init(&self) -> Self::State {
        None
    }

    fn step(
        &self,
        state: &Self::State,
        input: &Self::Input,
        output: Option<&Self::Output>,
    ) -> Option<Self::State> {
        let (next, answer) = Register::apply(state, input);
        match output {
            Some(o) if *o != answer => None,
            _ => Some(next),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use RegisterInput::*;
    use RegisterOutput as Out;

    type Op = Operation<RegisterInput<u32>, RegisterOutput<u32>>;

    fn reg() -> RegisterOf<u32> {
        RegisterOf::default()
    }

    fn op(client: usize, input: RegisterInput<u32>, call: u64, ret: u64, out: Out<u32>) -> Op {
        Operation::answered(client, input, call, ret, out)
    }

    #[test]
    fn a_sequential_history_that_follows_the_register_is_linearizable() {
        let h = vec![
            op(0, Read, 0, 1, Out::Read(None)),
            op(0, Write(1), 2, 3, Out::Written),
            op(1, Read, 4, 5, Out::Read(Some(1))),
            op(
                1,
                Cas {
                    expect: Some(1),
                    new: 2,
                },
                6,
                7,
                Out::Cas(true),
            ),
            op(
                0,
                Cas {
                    expect: Some(1),
                    new: 3,
                },
                8,
                9,
                Out::Cas(false),
            ),
            op(0, Read, 10, 11, Out::Read(Some(2))),
        ];
        assert_eq!(
            check(&reg(), &h),
            Verdict::Linearizable {
                order: vec![0, 1, 2, 3, 4, 5]
            }
        );
    }

    #[test]
    fn a_read_concurrent_with_a_write_may_see_either_value() {
        for seen in [None, Some(1)] {
            let h = vec![
                op(0, Write(1), 0, 10, Out::Written),
                op(1, Read, 2, 8, Out::Read(seen)),
            ];
            assert!(check(&reg(), &h).is_linearizable(), "{seen:?}");
        }
    }

    #[test]
    fn a_stale_read_after_a_completed_write_is_rejected() {
        // The write returned before the read was sent: the read must see it.
        let h = vec![
            op(0, Write(1), 0, 10, Out::Written),
            op(1, Read, 20, 30, Out::Read(None)),
        ];
        match check(&reg(), &h) {
            Verdict::NotLinearizable { longest, stuck } => {
                assert_eq!(longest, vec![0]);
                assert_eq!(stuck, vec![1]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn two_compare_and_sets_from_one_value_cannot_both_win() {
        // The known non-linearizable history: both conditional writes expected the
        // absent value and both say they wrote (a lost update).
        let h = vec![
            op(
                0,
                Cas {
                    expect: None,
                    new: 1,
                },
                0,
                10,
                Out::Cas(true),
            ),
            op(
                1,
                Cas {
                    expect: None,
                    new: 2,
                },
                1,
                11,
                Out::Cas(true),
            ),
        ];
        assert!(matches!(check(&reg(), &h), Verdict::NotLinearizable { .. }));
        // One of them losing is fine, whichever.
        for (a, b) in [(true, false), (false, true)] {
            let h = vec![
                op(
                    0,
                    Cas {
                        expect: None,
                        new: 1,
                    },
                    0,
                    10,
                    Out::Cas(a),
                ),
                op(
                    1,
                    Cas {
                        expect: None,
                        new: 2,
                    },
                    1,
                    11,
                    Out::Cas(b),
                ),
            ];
            assert!(check(&reg(), &h).is_linearizable());
        }
    }

    #[test]
    fn a_value_seen_cannot_be_unseen_by_a_later_read() {
        // Reads that overlap a write may flip to the new value once, never back.
        let h = vec![
            op(0, Write(1), 0, 100, Out::Written),
            op(1, Read, 10, 20, Out::Read(Some(1))),
            op(2, Read, 30, 40, Out::Read(None)),
        ];
        assert!(!check(&reg(), &h).is_linearizable());
        let h = vec![
            op(0, Write(1), 0, 100, Out::Written),
            op(1, Read, 10, 20, Out::Read(None)),
            op(2, Read, 30, 40, Out::Read(Some(1))),
        ];
        assert!(check(&reg(), &h).is_linearizable());
    }

    #[test]
    fn an_unanswered_call_may_take_effect_late_or_never() {
        // A write that never answered: a read long after may or may not see it...
        for seen in [None, Some(7)] {
            let h = vec![
                Operation::unanswered(0, Write(7), 0),
                op(1, Read, 1000, 1001, Out::Read(seen)),
            ];
            assert!(check(&reg(), &h).is_linearizable(), "{seen:?}");
        }
        // ... but it cannot have taken effect before it was sent...
        let h = vec![
            op(1, Read, 0, 1, Out::Read(Some(7))),
            Operation::unanswered(0, Write(7), 5),
        ];
        assert!(!check(&reg(), &h).is_linearizable());
        // ... nor be seen and then unseen.
        let h = vec![
            Operation::unanswered(0, Write(7), 0),
            op(1, Read, 10, 11, Out::Read(Some(7))),
            op(1, Read, 12, 13, Out::Read(None)),
        ];
        assert!(!check(&reg(), &h).is_linearizable());
    }

    #[test]
    fn keys_are_checked_apart_and_a_violation_names_its_key() {
        type KOp = Operation<(char, RegisterInput<u32>), RegisterOutput<u32>>;
        struct Keyed;
        impl Model for Keyed {
            type State = Option<u32>;
            type Input = (char, RegisterInput<u32>);
            type Output = RegisterOutput<u32>;
            fn init(&self) -> Option<u32> {
                None
            }
            fn step(
                &self,
                s: &Option<u32>,
                i: &Self::Input,
                o: Option<&Self::Output>,
            ) -> Option<Option<u32>> {
                reg().step(s, &i.1, o)
            }
        }
        let h: Vec<KOp> = vec![
            Operation::answered(0, ('a', Write(1)), 0, 1, Out::Written),
            Operation::answered(1, ('b', Write(2)), 0, 1, Out::Written),
            Operation::answered(0, ('a', Read), 2, 3, Out::Read(Some(1))),
            // Stale on b only.
            Operation::answered(1, ('b', Read), 2, 3, Out::Read(None)),
        ];
        match check_by_key(&Keyed, &h, |i| i.0) {
            Err(('b', Verdict::NotLinearizable { longest, stuck })) => {
                assert_eq!((longest, stuck), (vec![1], vec![3]));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn many_concurrent_clients_are_checked_within_the_budget() {
        // 12 clients, 40 rounds: each round every client writes its own value or
        // reads, all overlapping; the reads answer what a real register answers in a
        // chosen order, so the history is linearizable and the search must find it.
        let mut rng = crate::rng::Rng(7);
        let mut h = Vec::new();
        let mut value: Option<u32> = None;
        for round in 0..40u64 {
            let base = round * 100;
            let mut calls: Vec<(usize, RegisterInput<u32>)> = (0..12)
                .map(|c| {
                    if rng.below(2) == 0 {
                        (c, Write((round * 100 + c as u64) as u32))
                    } else {
                        (c, Read)
                    }
                })
                .collect();
            // Linearize in a shuffled order inside the round's overlap.
            for i in (1..calls.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                calls.swap(i, j);
            }
            for (c, input) in calls {
                let (next, out) = Register::apply(&value, &input);
                value = next;
                h.push(op(c, input, base + c as u64, base + 50 + c as u64, out));
            }
        }
        assert!(check(&reg(), &h).is_linearizable());
        // One read changed to a value never written makes it fail.
        let i = h.iter().rposition(|o| o.input == Read).expect("a read");
        h[i].ret = h[i].ret.take().map(|(t, _)| (t, Out::Read(Some(999_999))));
        assert!(matches!(check(&reg(), &h), Verdict::NotLinearizable { .. }));
    }
}
