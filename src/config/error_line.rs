//! Apart from validation because `fleetlink-fe` prints every fatal error through it (a load, a
//! validation, a failed start), not only configuration's.

/// An error and its causes on one line, each said once: many errors (ours, io's, redis')
/// already end with their cause's text, which `{:#}` would then print a second time.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.is_empty() {
            line = text;
        } else if !line.ends_with(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chain_says_each_cause_once() {
        let io = std::io::Error::from_raw_os_error(2);
        let text = format!("reading /nonexistent: {io}");
        let e = anyhow::Error::new(io).context(text.clone());
        assert_eq!(error_line(&e), text);
        let e = anyhow::anyhow!("inner").context("outer");
        assert_eq!(error_line(&e), "outer: inner");
    }
}
