//! RFC 6455 frame layer (sans-IO). Owned by the codec work.
