//! The extended resource name, checked as the kubelet checks it, and the CDI kind it gives.

use std::fmt;

use serde::Serialize;

use crate::cdi::Kind;

/// An extended resource name the kubelet accepts, read once: with the CDI kind it gives, or why
/// CDI cannot name it (checked when the cdi strategy is chosen).
#[derive(Clone, PartialEq, Eq)]
pub struct ResourceName {
    name: String,
    kind: Result<Kind, String>,
}

impl ResourceName {
    pub(super) fn parse(text: &str) -> Result<Self, String> {
        validate_resource_name(text)?;
        Ok(ResourceName {
            name: text.to_owned(),
            kind: Kind::of(text),
        })
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }

    pub(crate) fn cdi_kind(&self) -> Result<&Kind, &str> {
        self.kind.as_ref().map_err(String::as_str)
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// As the name alone, the way the start-up log and `config` have always shown it.
impl fmt::Debug for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.name, f)
    }
}

impl Serialize for ResourceName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

/// The kubelet's `IsExtendedResourceName`: `<dns-subdomain>/<name>`, outside `kubernetes.io`,
/// and `requests.<name>` must still be a qualified name.
pub(crate) fn validate_resource_name(name: &str) -> Result<(), String> {
    let invalid = |why: &str| Err(format!("invalid extended resource name {name:?}: {why}"));
    let Some((prefix, base)) = name.split_once('/') else {
        return invalid("must contain '/', e.g. vpc.amazonaws.com/efa");
    };
    if name.contains("kubernetes.io/") {
        return invalid("the kubernetes.io domain is reserved for native resources");
    }
    if name.starts_with("requests.") {
        return invalid("must not start with \"requests.\"");
    }
    if !is_dns_subdomain(&format!("requests.{prefix}")) {
        return invalid("the part before '/' must be a DNS subdomain");
    }
    if !is_qualified_name_part(base) {
        return invalid(
            "the part after '/' must be 1-63 alphanumerics, '-', '_' or '.', starting and ending alphanumeric",
        );
    }
    Ok(())
}

/// A lowercase RFC 1123 subdomain, as Kubernetes checks one: dot-separated labels of
/// lowercase alphanumerics and '-', each 1-63 long and alphanumeric at both ends, 253 at most.
pub(super) fn is_dns_subdomain(text: &str) -> bool {
    text.len() <= 253
        && text.split('.').all(|label| {
            let bytes = label.as_bytes();
            !bytes.is_empty()
                && bytes.len() <= 63
                && bytes
                    .iter()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
                && bytes[0].is_ascii_alphanumeric()
                && bytes[bytes.len() - 1].is_ascii_alphanumeric()
        })
}

fn is_qualified_name_part(text: &str) -> bool {
    let bytes = text.as_bytes();
    !bytes.is_empty()
        && bytes.len() <= 63
        && bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resource_name_knows_its_cdi_kind_or_why_it_has_none() {
        let name = ResourceName::parse("vpc.amazonaws.com/efa").unwrap();
        assert_eq!(name.as_str(), "vpc.amazonaws.com/efa");
        assert_eq!(
            name.cdi_kind().unwrap().to_string(),
            "vpc.amazonaws.com/efa"
        );
        // The kubelet takes a leading digit in the class; CDI does not.
        let name = ResourceName::parse("example.com/1efa").unwrap();
        assert!(name.cdi_kind().unwrap_err().contains("class \"1efa\""));
        assert!(ResourceName::parse("efa").is_err());
    }

    #[test]
    fn resource_names_follow_the_kubelet() {
        for good in [
            "vpc.amazonaws.com/efa",
            "example.com/efa_shared",
            "a.b/c.d-e",
        ] {
            assert_eq!(validate_resource_name(good), Ok(()), "{good}");
        }
        let long = format!("example.com/{}", "x".repeat(64));
        for bad in [
            "efa",
            "kubernetes.io/efa",
            "node.kubernetes.io/efa",
            "requests.example.com/efa",
            "Example.com/efa",
            "example.com/",
            "/efa",
            "example.com/efa-",
            "exa_mple.com/efa",
            long.as_str(),
        ] {
            assert!(validate_resource_name(bad).is_err(), "{bad}");
        }
    }
}
