//! HTTP/1.1 upgrade request parsing (sans-IO). Owned by the codec work.
