//! The task state machine: the one place that says which transitions are legal.
//!
//! | from | to |
//! |---|---|
//! | `submitted` | `working` (claim only), `rejected`, `canceled` |
//! | `working` | `input-required`, `completed`, `failed`, `canceled` |
//! | `input-required` | `working`, `canceled` |
//!
//! `completed`, `failed`, `canceled` and `rejected` are terminal: nothing leaves them.
//! One more edge exists outside the public table: when the assignee's session expired
//! or was taken over, the runtime **requeues** a `working` or `input-required` task
//! back to `submitted` (assignee cleared) so another session can claim it.
//!
//! The function here is pure; the store applies it to the state it read and makes the
//! write conditional on the version it read, so a decision is never applied to a
//! state it was not made for (and a terminal state is never overwritten).

use super::types::TaskState;

/// How a task is being moved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// `claim`: the agent's session takes a submitted task.
    Claim,
    /// `transition`: the agent (for a submitted task) or the assignee moves it.
    Transition,
    /// `cancel`: anyone cancels a task that is not terminal.
    Cancel,
    /// `requeue`: the runtime returns the task of a dead assignee to `submitted`.
    Requeue,
}

/// Why a move is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not an edge of the table (this includes every move out of a terminal state).
    Illegal,
    /// A claim of a task that is already `working` or `input-required`.
    AlreadyClaimed,
}

/// Whether `from` may become `to` by `via`.
pub fn check(from: TaskState, to: TaskState, via: Via) -> Result<(), Refusal> {
    use TaskState::*;
    if from.is_terminal() {
        return Err(Refusal::Illegal);
    }
    let legal = match via {
        Via::Claim => match (from, to) {
            (Submitted, Working) => true,
            (Working | InputRequired, Working) => return Err(Refusal::AlreadyClaimed),
            _ => false,
        },
        Via::Transition => matches!(
            (from, to),
            (Submitted, Rejected | Canceled)
                | (Working, InputRequired | Completed | Failed | Canceled)
                | (InputRequired, Working | Canceled)
        ),
        Via::Cancel => to == Canceled,
        Via::Requeue => matches!((from, to), (Working | InputRequired, Submitted)),
    };
    if legal {
        Ok(())
    } else {
        Err(Refusal::Illegal)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use TaskState::*;

    /// The table above, written out as data: every (from, to, via) that is legal.
    const LEGAL: &[(TaskState, TaskState, Via)] = &[
        (Submitted, Working, Via::Claim),
        (Submitted, Rejected, Via::Transition),
        (Submitted, Canceled, Via::Transition),
        (Working, InputRequired, Via::Transition),
        (Working, Completed, Via::Transition),
        (Working, Failed, Via::Transition),
        (Working, Canceled, Via::Transition),
        (InputRequired, Working, Via::Transition),
        (InputRequired, Canceled, Via::Transition),
        (Submitted, Canceled, Via::Cancel),
        (Working, Canceled, Via::Cancel),
        (InputRequired, Canceled, Via::Cancel),
        (Working, Submitted, Via::Requeue),
        (InputRequired, Submitted, Via::Requeue),
    ];

    const VIAS: [Via; 4] = [Via::Claim, Via::Transition, Via::Cancel, Via::Requeue];

    #[test]
    fn exactly_the_table_is_legal() {
        for from in TaskState::ALL {
            for to in TaskState::ALL {
                for via in VIAS {
                    let expected = LEGAL.contains(&(from, to, via));
                    let got = check(from, to, via);
                    assert_eq!(
                        got.is_ok(),
                        expected,
                        "{from} -> {to} via {via:?}: got {got:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn terminal_states_are_final() {
        for from in TaskState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for to in TaskState::ALL {
                for via in VIAS {
                    assert_eq!(check(from, to, via), Err(Refusal::Illegal));
                }
            }
        }
    }

    #[test]
    fn claiming_a_claimed_task_is_already_claimed() {
        assert_eq!(
            check(Working, Working, Via::Claim),
            Err(Refusal::AlreadyClaimed)
        );
        assert_eq!(
            check(InputRequired, Working, Via::Claim),
            Err(Refusal::AlreadyClaimed)
        );
        assert_eq!(check(Completed, Working, Via::Claim), Err(Refusal::Illegal));
    }

    #[test]
    fn a_submitted_task_starts_working_only_by_claim() {
        assert_eq!(
            check(Submitted, Working, Via::Transition),
            Err(Refusal::Illegal)
        );
        assert_eq!(check(Submitted, Working, Via::Claim), Ok(()));
    }
}
