//! One leased delivery, as a pull answers it and a stream sends it.

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::Value;

/// One leased delivery.
///
/// Its event is decoded on its own, after the answer around it: an event this client
/// cannot decode (nested deeper than serde_json's limit of 128, stored before meshd
/// refused such events at publish) is an `Err` for that delivery alone, with its
/// `delivery_id` there to ack or nack it. It never fails the pull or the stream
/// that carries it: a failed pull acks nothing, so its whole batch would come back
/// until `max_attempts` dead-lettered every innocent neighbour with it.
///
/// Serialized, it is the contract's delivery object again (an undecodable event as
/// the text meshd sent); use `serde_json::to_string`, not `to_value`, which would
/// have to decode that text.
#[derive(Debug, Clone, Deserialize)]
#[serde(from = "WireDelivery")]
pub struct Delivery {
    pub delivery_id: String,
    pub partition: u32,
    pub offset: u64,
    pub attempt: u32,
    /// The CloudEvent, structured mode, or why this client could not decode it.
    pub event: Result<Value, UndecodableEvent>,
}

/// A delivery's event that this client could not decode into a [`Value`].
#[derive(Debug, Clone, thiserror::Error)]
#[error("the event could not be decoded: {reason}")]
pub struct UndecodableEvent {
    /// serde_json's message (`recursion limit exceeded at line 1 column 140`, ...).
    pub reason: String,
    /// The event exactly as meshd sent it (valid JSON syntax: it was read as such).
    pub raw: Box<RawValue>,
}

/// A delivery as it is on the wire, its event not decoded yet: the answer decodes
/// whatever its events hold (a raw value is skipped without recursion).
#[derive(Deserialize)]
struct WireDelivery {
    delivery_id: String,
    partition: u32,
    offset: u64,
    attempt: u32,
    event: Box<RawValue>,
}

impl From<WireDelivery> for Delivery {
    fn from(w: WireDelivery) -> Self {
        let event = serde_json::from_str(w.event.get()).map_err(|e| UndecodableEvent {
            reason: e.to_string(),
            raw: w.event,
        });
        Delivery {
            delivery_id: w.delivery_id,
            partition: w.partition,
            offset: w.offset,
            attempt: w.attempt,
            event,
        }
    }
}

impl Serialize for Delivery {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut s = serializer.serialize_struct("Delivery", 5)?;
        s.serialize_field("delivery_id", &self.delivery_id)?;
        s.serialize_field("partition", &self.partition)?;
        s.serialize_field("offset", &self.offset)?;
        s.serialize_field("attempt", &self.attempt)?;
        match &self.event {
            Ok(event) => s.serialize_field("event", event)?,
            Err(undecodable) => s.serialize_field("event", &undecodable.raw)?,
        }
        s.end()
    }
}
