//! The paths of the public API (`../shared/design/http-api.md`), each written once:
//! the typed [`Client`](crate::Client) and the `meshd` CLI build their requests from
//! these. Names are percent-encoded as one path segment ([`segment`]), so a name can
//! never reach another route.

use crate::target::segment;

/// `/v1/cluster`
pub const CLUSTER: &str = "/v1/cluster";
/// `/v1/topics`
pub const TOPICS: &str = "/v1/topics";
/// `/v1/subscriptions`
pub const SUBSCRIPTIONS: &str = "/v1/subscriptions";
/// `/v1/deadletters`
pub const DEAD_LETTERS: &str = "/v1/deadletters";
/// `/v1/sessions`
pub const SESSIONS: &str = "/v1/sessions";
/// `/v1/tasks`
pub const TASKS: &str = "/v1/tasks";

/// `/v1/topics/{topic}`
pub fn topic(topic: &str) -> String {
    format!("{TOPICS}/{}", segment(topic))
}

/// `/v1/topics/{topic}/events` (publish, browse)
pub fn events(topic: &str) -> String {
    format!("{}/events", self::topic(topic))
}

/// `/v1/topics/{topic}/partitions/{partition}/events` (browse)
pub fn partition_events(topic: &str, partition: u32) -> String {
    format!("{}/partitions/{partition}/events", self::topic(topic))
}

/// `/v1/subscriptions/{name}`
pub fn subscription(name: &str) -> String {
    format!("{SUBSCRIPTIONS}/{}", segment(name))
}

/// `/v1/subscriptions/{name}/{action}`: `pull`, `ack`, `nack`, `extend`, `offsets`.
pub fn subscription_action(name: &str, action: &str) -> String {
    format!("{}/{action}", subscription(name))
}

/// `/v1/subscriptions/{name}/offsets/{partition}`
pub fn offset(name: &str, partition: u32) -> String {
    format!("{}/{partition}", subscription_action(name, "offsets"))
}

/// `/v1/deadletters/{id}`
pub fn dead_letter(id: &str) -> String {
    format!("{DEAD_LETTERS}/{}", segment(id))
}

/// `/v1/deadletters/{id}/redrive`
pub fn redrive(id: &str) -> String {
    format!("{}/redrive", dead_letter(id))
}

/// `/v1/sessions/{id}`
pub fn session(id: &str) -> String {
    format!("{SESSIONS}/{}", segment(id))
}

/// `/v1/sessions/{id}/heartbeat`
pub fn heartbeat(id: &str) -> String {
    format!("{}/heartbeat", session(id))
}

/// `/v1/tasks/{id}`
pub fn task(id: &str) -> String {
    format!("{TASKS}/{}", segment(id))
}

/// `/v1/tasks/{id}/{action}`: `claim`, `transition`, `cancel`.
pub fn task_action(id: &str, action: &str) -> String {
    format!("{}/{action}", task(id))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_stay_one_segment() {
        assert_eq!(topic("orders"), "/v1/topics/orders");
        assert_eq!(events("a/b"), "/v1/topics/a%2Fb/events");
        assert_eq!(offset("s", 3), "/v1/subscriptions/s/offsets/3");
        assert_eq!(subscription_action("s", "pull"), "/v1/subscriptions/s/pull");
        assert_eq!(redrive("x?y"), "/v1/deadletters/x%3Fy/redrive");
        assert_eq!(heartbeat("..."), "/v1/sessions/.../heartbeat");
        assert_eq!(task_action("t", "cancel"), "/v1/tasks/t/cancel");
    }
}
