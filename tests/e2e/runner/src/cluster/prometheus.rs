//! The suite's real Prometheus, through its HTTP API on loopback.

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::http;

pub struct Prometheus {
    pub port: u16,
}

impl Prometheus {
    /// From the URL the suite gives (`http://127.0.0.1:PORT`): Prometheus listens on loopback
    /// only.
    pub fn at(url: &str) -> Result<Prometheus> {
        let port = url
            .strip_prefix("http://127.0.0.1:")
            .and_then(|port| port.trim_end_matches('/').parse().ok())
            .with_context(|| format!("Prometheus at {url:?}, not on loopback"))?;
        Ok(Prometheus { port })
    }

    /// The instant vector `expr` evaluates to: each sample's labels.
    pub fn query(&self, expr: &str) -> Result<Vec<Value>> {
        let body = http::get(self.port, &format!("/api/v1/query?query={}", encode(expr)))?;
        let answer: Value = serde_json::from_str(&body).context("Prometheus answered no JSON")?;
        if answer["status"] != "success" {
            bail!("query {expr}: {}", answer["error"]);
        }
        Ok(answer["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|sample| sample["metric"].clone())
            .collect())
    }

    /// Whether `alert` fires with each of `labels`; an empty value matches a missing label.
    pub fn firing(&self, alert: &str, labels: &[(&str, &str)]) -> Result<bool> {
        let matchers: String = labels
            .iter()
            .map(|(name, value)| format!(", {name}=\"{value}\""))
            .collect();
        let expr = format!("ALERTS{{alertname=\"{alert}\", alertstate=\"firing\"{matchers}}}");
        Ok(!self.query(&expr)?.is_empty())
    }

    /// The alerts named `alert` as `device holder state` lines, for a failure's reason.
    pub fn alerts(&self, alert: &str) -> String {
        match self.query(&format!("ALERTS{{alertname=\"{alert}\"}}")) {
            Ok(samples) => samples
                .iter()
                .map(|labels| {
                    format!(
                        "{} {} {}",
                        labels["device"].as_str().unwrap_or("-"),
                        labels["holder"].as_str().unwrap_or("-"),
                        labels["alertstate"].as_str().unwrap_or("-")
                    )
                })
                .collect::<Vec<_>>()
                .join("|"),
            Err(err) => format!("(cannot ask Prometheus: {err:#})"),
        }
    }

    /// The job's active targets as `health scrapeUrl lastError` lines, for a failure's reason.
    pub fn targets(&self, job: &str) -> String {
        let answer = http::get(self.port, "/api/v1/targets?state=active")
            .and_then(|body| Ok(serde_json::from_str::<Value>(&body)?));
        match answer {
            Ok(answer) => answer["data"]["activeTargets"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|target| target["labels"]["job"] == job)
                .map(|target| {
                    format!(
                        "{} {} {}",
                        target["health"].as_str().unwrap_or("-"),
                        target["scrapeUrl"].as_str().unwrap_or("-"),
                        target["lastError"].as_str().unwrap_or("-")
                    )
                })
                .collect::<Vec<_>>()
                .join("|"),
            Err(err) => format!("(cannot ask Prometheus: {err:#})"),
        }
    }
}

/// A query string value, percent-encoded but for RFC 3986's unreserved characters.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_is_percent_encoded() {
        assert_eq!(
            encode(r#"ALERTS{alertname="A b"}"#),
            "ALERTS%7Balertname%3D%22A%20b%22%7D"
        );
    }

    #[test]
    fn prometheus_is_found_on_loopback_only() {
        assert_eq!(
            Prometheus::at("http://127.0.0.1:19090").unwrap().port,
            19090
        );
        assert!(Prometheus::at("http://198.18.0.1:19090").is_err());
    }
}
