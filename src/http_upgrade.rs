//! TEMPORARY STUB of the upgrade API (replaced by the real parser).
#![allow(missing_docs, unused_variables)]
#[derive(Debug)]
pub struct UpgradeRequest { pub path: String, pub key: String, pub authorization: Option<String>, pub offered_deflate: bool }
#[derive(Debug, thiserror::Error)]
pub enum Reject { #[error("400")] BadRequest, #[error("404")] NotFound, #[error("405")] MethodNotAllowed, #[error("426")] UpgradeRequired, #[error("431")] HeaderTooLarge }
impl Reject { pub fn status(&self) -> u16 { 400 } pub fn response(&self) -> Vec<u8> { vec![] } }
pub fn parse_request(buf: &[u8], max_head: usize, known_path: impl Fn(&str) -> bool) -> Result<Option<(usize, UpgradeRequest)>, Reject> { Ok(None) }
pub fn accept_key(key: &str) -> String { String::new() }
pub fn switching_protocols(key: &str) -> Vec<u8> { vec![] }
pub fn service_unavailable(retry_after_s: u32) -> Vec<u8> { vec![] }
pub fn unauthorized() -> Vec<u8> { vec![] }
