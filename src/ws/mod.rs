//! TEMPORARY STUB of the codec API (replaced by the real codec).
#![allow(missing_docs, unused_variables)]
#[derive(Clone, Copy, Debug)]
pub struct Limits { pub max_message: usize, pub max_fragments: usize }
#[derive(Debug)]
pub enum Message { Text(String), Binary(Vec<u8>), Ping(Vec<u8>), Pong(Vec<u8>), Close(Option<CloseFrame>) }
#[derive(Debug)]
pub struct CloseFrame { pub code: u16, pub reason: String }
pub struct Decoder { limits: Limits }
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError { #[error("x")] Protocol }
impl ProtocolError { pub fn close_code(&self) -> u16 { 1002 } }
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpCode { Continuation, Text, Binary, Close, Ping, Pong }
impl Decoder {
    pub fn new(limits: Limits) -> Decoder { Decoder { limits } }
    pub fn decode(&mut self, input: &[u8]) -> Result<Option<(usize, Option<Message>)>, ProtocolError> { Ok(None) }
    pub fn is_idle(&self) -> bool { true }
}
pub fn encode_frame(out: &mut Vec<u8>, opcode: OpCode, payload: &[u8]) {}
pub fn encode_close(out: &mut Vec<u8>, code: u16, reason: &str) {}
pub fn apply_mask(buf: &mut [u8], key: [u8; 4]) {}
pub fn encode_client_frame(out: &mut Vec<u8>, fin: bool, opcode: OpCode, key: [u8;4], payload: &[u8]) {}
