//! What the relay and the consumer agree on.
//!
//! Every value that crosses the broker is parsed once, at the edge, into a type that cannot hold an
//! invalid value: an [`OperationKey`] names one business action for its whole life, a
//! [`CanonicalPayload`] is the approved JSON in RFC 8785 canonical form, its [`PayloadHash`] binds the
//! approval to those exact bytes, and an [`Envelope`] is the CloudEvents 1.0 event that carries them.

pub mod backoff;
pub mod config;
pub mod envelope;
mod json_string;
pub mod key;
pub mod logging;
pub mod migrate;
pub mod observe;
pub mod payload;
pub mod signing;
pub mod subject;
pub mod timestamp;
pub mod trace;

pub use backoff::Backoff;
pub use envelope::{Approval, Envelope, EnvelopeError, OutgoingEnvelope};
pub use key::{KeyError, OperationKey, action_type_of};
pub use payload::{CanonicalPayload, PayloadError, PayloadHash, PayloadText};
pub use subject::{Subjects, headers};
pub use trace::TraceParent;
