//! The one error type of the frame layer, and the close code each violation maps to.

/// A frame or message that breaks RFC 6455; the connection must be failed (§7.1.7) with
/// [`ProtocolError::close_code`]. A decoder that returned an error must not be used again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// RSV1, RSV2 or RSV3 is set, but no extension was negotiated (§5.2).
    #[error("reserved bits set without a negotiated extension")]
    ReservedBits,
    /// The opcode is one of the reserved values 0x3-0x7 or 0xB-0xF (§5.2).
    #[error("reserved opcode {0:#x}")]
    ReservedOpCode(u8),
    /// A client frame without the MASK bit (§5.1: the server MUST close the connection).
    #[error("client frame is not masked")]
    UnmaskedFrame,
    /// A control frame with FIN clear (§5.5: control frames MUST NOT be fragmented).
    #[error("fragmented control frame")]
    FragmentedControl,
    /// A control frame whose 7-bit length is above 125 (§5.5): its payload is longer than 125
    /// bytes, or its length is in an extended form, which is then not minimal (§5.2). Refused
    /// before the extended length arrives.
    #[error("control frame length above 125 (a longer payload, or an extended length form)")]
    ControlTooLong,
    /// A payload length not written in the minimal number of bytes (§5.2).
    #[error("payload length not minimally encoded")]
    NonMinimalLength,
    /// A 64-bit payload length with its most significant bit set (§5.2).
    #[error("64-bit payload length with the most significant bit set")]
    LengthMsbSet,
    /// A continuation frame with no fragmented message in progress (§5.4).
    #[error("continuation frame without a message in progress")]
    UnexpectedContinuation,
    /// A new text or binary frame while a fragmented message is in progress (§5.4: fragments
    /// of different messages MUST NOT be interleaved).
    #[error("new data frame inside a fragmented message")]
    InterleavedMessage,
    /// A close frame with a 1-byte payload, too short for a status code (§5.5.1).
    #[error("close frame payload of 1 byte")]
    CloseTooShort,
    /// A close frame with a status code that may not be sent on the wire (§7.4).
    #[error("invalid close code {0}")]
    InvalidCloseCode(u16),
    /// A text message that is not valid UTF-8 (§8.1).
    #[error("invalid UTF-8 in text")]
    InvalidUtf8,
    /// A close frame's reason that is not valid UTF-8 (§5.5.1): the same code as a text
    /// message's, told apart in the reason, as the peer may look for its own mistake in either.
    #[error("invalid UTF-8 in the close reason")]
    InvalidCloseReason,
    /// The reassembled message would exceed `Limits::max_message` bytes; detected from the
    /// frame header, before any of the payload is buffered.
    #[error("message longer than {limit} bytes")]
    MessageTooBig {
        /// The limit in force.
        limit: usize,
    },
    /// The message has more than `Limits::max_fragments` frames.
    #[error("message in more than {limit} frames")]
    TooManyFragments {
        /// The limit in force.
        limit: usize,
    },
}

impl ProtocolError {
    /// The status code to close the connection with (§7.4.1): 1002 for protocol errors, 1007
    /// for invalid UTF-8, 1009 for a message over the limits.
    pub fn close_code(&self) -> u16 {
        match self {
            ProtocolError::InvalidUtf8 | ProtocolError::InvalidCloseReason => 1007,
            ProtocolError::MessageTooBig { .. } | ProtocolError::TooManyFragments { .. } => 1009,
            ProtocolError::ReservedBits
            | ProtocolError::ReservedOpCode(_)
            | ProtocolError::UnmaskedFrame
            | ProtocolError::FragmentedControl
            | ProtocolError::ControlTooLong
            | ProtocolError::NonMinimalLength
            | ProtocolError::LengthMsbSet
            | ProtocolError::UnexpectedContinuation
            | ProtocolError::InterleavedMessage
            | ProtocolError::CloseTooShort
            | ProtocolError::InvalidCloseCode(_) => 1002,
        }
    }
}
