//! The RFC 6455 frame layer, sans-IO: bytes in, messages out; messages in, bytes out.
//!
//! The connection loop (`worker/conn.rs`) feeds what it reads to a [`Decoder`] and writes what
//! the `encode_*` functions append to its output buffer; nothing here touches a socket or a
//! clock. The decoder enforces the RFC on client→server frames and answers every violation with
//! a [`ProtocolError`] that knows its close code (1002, 1007, 1009). No extension is ever
//! negotiated, so the RSV bits are always an error.
//!
//! | file | concern |
//! |---|---|
//! | `frame.rs` | header parsing (§5.2), [`OpCode`], close-code validity (§7.4) |
//! | `decoder.rs` | reassembly (§5.4), control frames (§5.5), limits, UTF-8 (§8.1) |
//! | `utf8.rs` | incremental UTF-8 validation across fragments |
//! | `encode.rs` | server frames, close frames, masked client frames |
//! | `mask.rs` | [`apply_mask`] (§5.3) |
//! | `error.rs` | [`ProtocolError`] |

mod decoder;
mod encode;
mod error;
mod frame;
mod mask;
mod utf8;

pub use decoder::Decoder;
pub use encode::{encode_client_frame, encode_close, encode_frame};
pub use error::ProtocolError;
pub use frame::{is_valid_close_code, OpCode};
pub use mask::apply_mask;

/// Bounds on one inbound data message; control frames are bounded by the RFC (125 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of reassembled payload in one text or binary message; a frame that would
    /// take a message past it is refused from its header with 1009 (`--max-message`).
    pub max_message: usize,
    /// Most frames in one message, counting the first; one more is refused with 1009. It bounds
    /// the work an attacker can cause with many empty fragments.
    pub max_fragments: usize,
}

/// A complete message, or a control frame, from the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// A text message, valid UTF-8 (§5.6).
    Text(String),
    /// A binary message.
    Binary(Vec<u8>),
    /// A ping (§5.5.2); answer with a pong carrying the same payload.
    Ping(Vec<u8>),
    /// A pong (§5.5.3), solicited or not.
    Pong(Vec<u8>),
    /// A close frame (§5.5.1); `None` when it carried no status code.
    Close(Option<CloseFrame>),
}

/// The body of a close frame that carried a status code (§5.5.1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloseFrame {
    /// A status code that [`is_valid_close_code`] accepts.
    pub code: u16,
    /// The reason, possibly empty; at most 123 bytes.
    pub reason: String,
}

#[cfg(test)]
mod tests;
