//! The crate's top-level modules depend on each other in one direction only, and the product
//! never reaches into the test kit, apart from the demo. Both are read from the source, so a new `use` that closes a
//! cycle fails here, named, before anyone has to untangle it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

const TEST_KIT: &str = "testkit";
/// The one product module built on the test kit, compiled only with the `demo` feature, which
/// the image build leaves off.
const DEMO: &str = "demo";

/// Top-level module -> the top-level modules its non-test code names through `crate::`.
type Graph = BTreeMap<String, BTreeSet<String>>;

#[test]
fn top_level_modules_form_no_cycle() {
    let graph = graph(Path::new(env!("CARGO_MANIFEST_DIR")).join("src").as_path());
    assert!(graph.len() > 10, "the source was not found: {graph:?}");
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle between modules: {}", cycle.join(" -> "));
    }
}

#[test]
fn the_product_never_uses_the_test_kit() {
    let graph = graph(Path::new(env!("CARGO_MANIFEST_DIR")).join("src").as_path());
    let users: Vec<&String> = graph
        .iter()
        .filter(|(module, uses)| {
            ![TEST_KIT, DEMO].contains(&module.as_str()) && uses.contains(TEST_KIT)
        })
        .map(|(module, _)| module)
        .collect();
    assert!(
        users.is_empty(),
        "product modules use the test kit: {users:?}"
    );
}

#[test]
fn the_check_sees_cycles_and_skips_test_code() {
    let mut graph = Graph::new();
    let mut add = |module: &str, source: &str| {
        graph.insert(module.to_owned(), uses(&strip_test_code(source), module));
    };
    add(
        "a",
        "use crate::b::X;\n#[cfg(test)]\nmod tests { use crate::c::Y; }\n",
    );
    add(
        "b",
        "use crate::{c::Z, d};\nfn f() { let _ = \"}\"; crate::a::g(); }",
    );
    add("c", "// crate::a is only mentioned\n");
    assert_eq!(graph["a"], BTreeSet::from(["b".to_owned()]));
    assert_eq!(
        find_cycle(&graph),
        Some(vec!["a".into(), "b".into(), "a".into()])
    );
    graph.get_mut("b").unwrap().remove("a");
    assert_eq!(find_cycle(&graph), None);
}

fn graph(src: &Path) -> Graph {
    let mut graph = Graph::new();
    for file in rust_files(src) {
        let relative = file.strip_prefix(src).unwrap();
        let top = relative
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_owned();
        if top == "lib" || top == "main" {
            continue;
        }
        let source = std::fs::read_to_string(&file).unwrap();
        let found = uses(&strip_test_code(&source), &top);
        graph.entry(top).or_default().extend(found);
    }
    graph
}

fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The modules named as `crate::name` or inside `crate::{name, other::…}`, other than `own`.
fn uses(code: &str, own: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let rest = &code[at + "crate::".len()..];
        let names: Vec<&str> = match rest.strip_prefix('{') {
            Some(group) => {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                group
                    .split(',')
                    .filter_map(|item| item.trim().split("::").next())
                    .collect()
            }
            None => vec![
                rest.split(|c: char| !c.is_alphanumeric() && c != '_')
                    .next()
                    .unwrap(),
            ],
        };
        found.extend(
            names
                .into_iter()
                .filter(|name| !name.is_empty() && *name != own && *name != "self")
                .map(str::to_owned),
        );
    }
    found
}

/// The code without comments, string contents and `#[cfg(test)]` items, which may use anything.
fn strip_test_code(source: &str) -> String {
    let code = strip_comments_and_strings(source);
    let mut kept = String::with_capacity(code.len());
    let mut rest = code.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        kept.push_str(&rest[..at]);
        let item = &rest[at..];
        // The item ends at its matching closing brace, or at `;` for a braceless one.
        let mut depth = 0usize;
        let mut end = item.len();
        for (i, c) in item.char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                ';' if depth == 0 => {
                    end = i + 1;
                    break;
                }
                _ => {}
            }
        }
        rest = &item[end..];
    }
    kept.push_str(rest);
    kept
}

fn strip_comments_and_strings(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut chars = source.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '"' => {
                out.push_str("\"\"");
                let mut escaped = false;
                for c in chars.by_ref() {
                    match (escaped, c) {
                        (false, '\\') => escaped = true,
                        (false, '"') => break,
                        _ => escaped = false,
                    }
                }
            }
            // A char literal such as '{' must not count as a brace; a lifetime passes through.
            '\'' => {
                let literal: String = chars.clone().take(3).collect();
                if literal.chars().nth(1) == Some('\'') {
                    chars.nth(1);
                } else if literal.starts_with('\\') {
                    while chars.next().is_some_and(|c| c != '\'') {}
                } else {
                    out.push(c);
                }
            }
            _ => out.push(c),
        }
    }
    out
}

/// A path `a -> … -> a`, if the graph has a cycle.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        module: &str,
        graph: &Graph,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|m| m == module) {
            let mut cycle = path[start..].to_vec();
            cycle.push(module.to_owned());
            return Some(cycle);
        }
        if done.contains(module) {
            return None;
        }
        path.push(module.to_owned());
        for next in graph.get(module).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(module.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|module| visit(module, graph, &mut Vec::new(), &mut done))
}
