//! The architecture invariants that can be read from the source (ARCHITECTURE.md lists them):
//! modules at every depth depend on each other in one direction only; the product never reaches
//! into the test kit, apart from the demo; Allocate does no I/O; only `config` names host paths;
//! each snapshot has one writing module, and no other module holds a raw `watch` channel; no
//! domain module imports `config`. A change that breaks one fails here, named, before anyone has
//! to untangle it.
//!
//! A module is a path such as `telemetry::fds`. Its non-test code names another module through
//! `crate::`, `super::`, `self::` or the name of one of its own submodules; the name resolves to
//! the longest module path it starts with, so `super::http::MAX` in `telemetry::fds` is an edge
//! to `telemetry::http`. Run with `--nocapture` to see each module's floor: 0 for a module that
//! names none of the others, else one above the highest module it names.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const TEST_KIT: &str = "testkit";
/// The one product module built on the test kit, compiled only with the `demo` feature, which
/// the image build leaves off.
const DEMO: &str = "demo";

/// Module path -> the module paths its non-test code names.
type Graph = BTreeMap<String, BTreeSet<String>>;

#[test]
fn modules_form_no_cycle_at_any_depth() {
    let graph = crate_graph();
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle between modules: {}", cycle.join(" -> "));
    }
    let floors = floors(&graph);
    for (floor, modules) in floors.iter().enumerate() {
        println!("floor {floor}: {}", modules.join(" "));
    }
    assert_eq!(
        floors.iter().map(Vec::len).sum::<usize>(),
        graph.len(),
        "every module stands on a floor"
    );
}

#[test]
fn the_product_never_uses_the_test_kit() {
    let graph = crate_graph();
    let users: Vec<&String> = graph
        .iter()
        .filter(|(module, uses)| {
            ![TEST_KIT, DEMO].contains(&top(module)) && uses.iter().any(|m| top(m) == TEST_KIT)
        })
        .map(|(module, _)| module)
        .collect();
    assert!(
        users.is_empty(),
        "product modules use the test kit: {users:?}"
    );
}

/// Allocate answers from the snapshot alone: the kubelet waits on it with no deadline.
#[test]
fn allocation_does_no_io() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let io = ["std::fs", "tokio::fs", "std::process", "tokio::net"];
    let io_modules = ["fsread", "fswatch", "hostfile", "uds"];
    let graph = crate_graph();
    for (module, uses) in graph.iter().filter(|(m, _)| top(m) == "allocation") {
        let named: Vec<&String> = uses
            .iter()
            .filter(|m| io_modules.contains(&top(m)))
            .collect();
        assert!(named.is_empty(), "{module} uses I/O modules {named:?}");
    }
    for file in rust_files(&src.join("allocation")) {
        let code = strip_test_code(&std::fs::read_to_string(&file).unwrap());
        for path in io {
            assert!(!code.contains(path), "{} names {path}", file.display());
        }
    }
}

/// Filesystem roots are settings, passed down: a host path written anywhere else would escape
/// `--sysfs-root` and `--dev-root` (and the tests' simulated nodes).
#[test]
fn only_config_names_host_paths() {
    let roots = ["/sys", "/dev", "/var", "/run", "/etc", "/proc"];
    // Where a container finds its nodes, not where the plugin looks on the host.
    let container_paths = ["\"/dev/infiniband\""];
    let mut named = Vec::new();
    for (module, file) in product_files() {
        if top(&module) == "config" {
            continue;
        }
        let code = strip_test_items(&std::fs::read_to_string(&file).unwrap());
        for line in code.lines().filter(|l| !l.trim_start().starts_with("//")) {
            let literal_roots = roots.iter().map(|root| format!("\"{root}"));
            if literal_roots.into_iter().any(|root| line.contains(&root))
                && !container_paths.iter().any(|path| line.contains(path))
            {
                named.push(format!("{module}: {}", line.trim()));
            }
        }
    }
    assert!(named.is_empty(), "host paths outside config: {named:#?}");
}

/// Each snapshot's writers, none of them `Clone`, and the modules that may name them: the one
/// module that writes through it, `app`, which creates it and hands it over, and `state`, which
/// defines the device snapshot's two writers (one per input) and the generic `Writer<T>`.
const WRITERS: [(&str, &[&str]); 7] = [
    // Wrapped by the device snapshot's two writers below, which alone reach it.
    ("Writer<Arc<Inventory>>", &["state"]),
    ("DeviceState", &["app", "health", "state"]),
    ("ConflictWriter", &["app", "conflict", "state"]),
    ("Writer<Registration>", &["app", "lifecycle"]),
    ("Writer<Competition>", &["app", "competitor"]),
    ("Writer<Arc<Holdings>>", &["app", "holdings"]),
    ("Writer<Arc<[DeviceNode]>>", &["app", "extra_nodes"]),
];

/// One writing module per snapshot: a writer is named only where [`WRITERS`] says, and every
/// `Writer<..>` the product names is one of them, so a new snapshot gets its row here.
#[test]
fn each_snapshot_has_one_writing_module() {
    let code: BTreeMap<String, String> = product_files()
        .into_iter()
        .map(|(module, file)| {
            let code = strip_test_code(&std::fs::read_to_string(file).unwrap());
            (module, code.split_whitespace().collect())
        })
        .collect();
    for (writer, allowed) in WRITERS {
        let mut naming: Vec<&str> = code
            .iter()
            .filter(|(_, code)| names_type(code, writer))
            .map(|(module, _)| top(module))
            .collect();
        // A module that is a folder names it from several files.
        naming.dedup();
        assert_eq!(naming, allowed, "the modules that name {writer}");
    }
    for (module, code) in &code {
        for (at, _) in code.match_indices("Writer<") {
            let named = &code[at..];
            assert!(
                WRITERS.iter().any(|(writer, _)| named.starts_with(writer))
                    || named.starts_with("Writer<T>"),
                "{module} names a writer WRITERS has no row for: {}",
                &named[..named.len().min(40)]
            );
        }
    }
}

/// The modules that may name tokio's `watch` anywhere, and why.
const RAW_WATCH_MODULES: [(&str, &str); 2] = [
    (
        "state",
        "the snapshots' own channel, which Writer and Reader wrap",
    ),
    (
        TEST_KIT,
        "test code: the stand-in kubelet's record of what the plugin told it",
    ),
];

/// The sites, as the code reads them (whitespace aside), where another module may name tokio's
/// `watch`, and why.
const RAW_WATCH_SITES: [(&str, &str, &[&str]); 2] = [
    (
        "service",
        "the per-generation stream hooks: signals, not snapshots, that one generation's streams \
         raise and its lifecycle awaits; the senders are private, so only `service` writes them",
        &[
            "use tokio::sync::{Notify, watch};",
            "open: watch::Sender<usize>,",
            "kubelet_stream: watch::Sender<bool>,",
            "fn open_streams(&self) -> watch::Receiver<usize>",
            "fn kubelet_stream(&self) -> watch::Receiver<bool>",
        ],
    ),
    (
        "hostfile",
        "the receivers `follow` subscribes to the readers it is given, each remembering what the \
         last render saw, so the next wait ends only on a later change",
        &[
            "use tokio::sync::watch;",
            "struct Inputs { devices: watch::Receiver<Arc<Inventory>>, \
             holdings: Option<watch::Receiver<Arc<Holdings>>>,",
            "async fn view_changed(view: &mut Option<watch::Receiver<Arc<Holdings>>>)",
        ],
    ),
];

/// Outside `state`, a snapshot is a `Writer` and its `Reader`s, never a raw `watch` channel: a
/// `watch::Sender` is `Clone`, so it would give a snapshot as many writers as clones, and a
/// `watch::Receiver` parameter invites a caller to feed it from a channel of its own. Test code
/// counts too, apart from the sites [`RAW_WATCH_MODULES`] and [`RAW_WATCH_SITES`] name.
#[test]
fn no_module_but_state_holds_a_raw_watch_channel() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = module_files();
    for (module, why) in RAW_WATCH_MODULES {
        assert!(
            files.keys().any(|m| top(m) == module),
            "RAW_WATCH_MODULES names {module} ({why}), which is gone"
        );
    }
    let mut named = Vec::new();
    for (module, file) in files {
        if RAW_WATCH_MODULES.iter().any(|(m, _)| *m == top(&module)) {
            continue;
        }
        let source = std::fs::read_to_string(&file).unwrap();
        let code = one_line(&strip_comments_and_strings(&source));
        let mut sites = Vec::new();
        for (_, why, listed) in RAW_WATCH_SITES.iter().filter(|(m, ..)| *m == module) {
            for site in listed.iter().map(|site| one_line(site)) {
                assert!(
                    code.contains(&site),
                    "{module} no longer has `{site}` ({why}): fix or drop it in RAW_WATCH_SITES"
                );
                sites.push(site);
            }
        }
        let allowed = |at: usize| {
            sites.iter().any(|site| {
                code.match_indices(site.as_str())
                    .any(|(from, _)| (from..from + site.len()).contains(&at))
            })
        };
        for at in raw_watch_namings(&code).filter(|at| !allowed(*at)) {
            let excerpt: String = code[at..].chars().take(60).collect();
            named.push(format!(
                "{}: `{excerpt}`",
                file.strip_prefix(root).unwrap().display()
            ));
        }
    }
    assert!(
        named.is_empty(),
        "tokio's watch named outside `state`: a snapshot has one `state::Writer` and is read \
         through `state::Reader`s (a site that needs a raw channel is a row of RAW_WATCH_SITES, \
         with its reason):\n{}",
        named.join("\n")
    );
}

/// Where `code` names tokio's `watch` module: a path through `sync::watch`
/// (`tokio::sync::watch::channel`, `use tokio::sync::{Notify, watch}`), or one that starts at
/// `watch::`, as after such an import.
fn raw_watch_namings(code: &str) -> impl Iterator<Item = usize> + '_ {
    path_starts(code).filter_map(|(at, word)| {
        let paths = use_tree(&code[at + word.len() + "::".len()..], &[word]);
        paths
            .iter()
            .any(|path| path[0] == "watch" || path.windows(2).any(|w| w == ["sync", "watch"]))
            .then_some(at)
    })
}

/// `code` with each run of whitespace as one space, as a site in [`RAW_WATCH_SITES`] is written.
fn one_line(code: &str) -> String {
    code.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_watch_check_sees_every_spelling() {
    let namings = |code: &str| raw_watch_namings(code).count();
    for spelling in [
        "use tokio::sync::watch;",
        "use tokio::sync::{Notify, watch};",
        "use tokio::{sync::watch, task};",
        "use tokio::sync::watch::{channel, Sender};",
        "let (tx, rx) = tokio::sync::watch::channel(0);",
        "fn f(found: Option<watch::Receiver<Arc<[DeviceNode]>>>) {}",
        "let sync = sync::watch::Sender::new(0);",
    ] {
        // A path inside a use group is also a path of its own, so it may be seen twice.
        assert_ne!(namings(spelling), 0, "{spelling}");
    }
    for other in [
        "use tokio::sync::{Mutex, Notify};",
        "use crate::fswatch::DirWatch;",
        "use tokio_stream::wrappers::WatchStream;",
        "let events = watch.next().await;",
        "let found: Reader<Arc<[DeviceNode]>> = writer.reader();",
    ] {
        assert_eq!(namings(other), 0, "{other}");
    }
}

/// Whether `code` names the type `name` as a whole word.
fn names_type(code: &str, name: &str) -> bool {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices(name).any(|(at, _)| {
        !code[..at].ends_with(is_word) && !code[at + name.len()..].starts_with(is_word)
    })
}

/// Settings reach the domain modules as plain values: only the modules that read the command
/// line and the config file, or act on them for the operator, import `config`. A domain module
/// that did would stand above every setting's parser and make the house taller for nothing.
#[test]
fn no_domain_module_imports_config() {
    let readers = ["app", "config", "demo", "list", TEST_KIT];
    let graph = crate_graph();
    let importers: Vec<&String> = graph
        .iter()
        .filter(|(module, uses)| {
            !readers.contains(&top(module)) && uses.iter().any(|m| top(m) == "config")
        })
        .map(|(module, _)| module)
        .collect();
    assert!(
        importers.is_empty(),
        "domain modules import config: {importers:?}"
    );
}

#[test]
fn the_check_sees_cycles_inside_folders_and_skips_test_code() {
    let modules: BTreeSet<String> = ["a", "b", "c", "t", "t::x", "t::y", "t::y::z"]
        .map(str::to_owned)
        .into();
    let edges = |module: &str, source: &str| uses(&strip_test_code(source), module, &modules);
    assert_eq!(
        edges(
            "a",
            "use crate::b::X;\n#[cfg(test)]\nmod tests { use crate::c::Y; }\n"
        ),
        BTreeSet::from(["b".to_owned()])
    );
    assert_eq!(
        edges(
            "b",
            "use crate::{c::Z, t::{self, y::z::W}};\nfn f() { let _ = \"}\"; crate::a::g(); }"
        ),
        ["a", "c", "t", "t::y::z"].map(str::to_owned).into()
    );
    assert_eq!(
        edges("c", "// crate::a is only mentioned\n"),
        BTreeSet::new()
    );
    // Inside a folder: through super::, self::, a submodule's own name, and super::super::.
    assert_eq!(
        edges("t::x", "use super::y::Z;\nfn f() { std::y::g(); }"),
        BTreeSet::from(["t::y".to_owned()])
    );
    assert_eq!(
        edges("t", "use y::z::W;\nuse self::x::V;\nfn f() { a::b(); }"),
        ["t::x", "t::y::z"].map(str::to_owned).into()
    );
    assert_eq!(
        edges("t::y::z", "use super::super::{x, Top};"),
        ["t", "t::x"].map(str::to_owned).into()
    );

    let mut graph: Graph = modules
        .iter()
        .map(|m| (m.clone(), BTreeSet::new()))
        .collect();
    let link = |graph: &mut Graph, from: &str, to: &str| {
        graph.get_mut(from).unwrap().insert(to.to_owned());
    };
    link(&mut graph, "t::x", "t::y");
    link(&mut graph, "t::y", "t::y::z");
    assert_eq!(find_cycle(&graph), None);
    assert_eq!(floors(&graph)[2], vec!["t::x".to_owned()]);
    link(&mut graph, "t::y::z", "t::x");
    assert_eq!(
        find_cycle(&graph),
        Some(
            ["t::x", "t::y", "t::y::z", "t::x"]
                .map(str::to_owned)
                .into()
        )
    );
}

/// Every module's file, by module path.
fn module_files() -> BTreeMap<String, PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files: BTreeMap<String, PathBuf> = rust_files(&src)
        .into_iter()
        .filter_map(|file| Some((module_path(file.strip_prefix(&src).unwrap())?, file)))
        .collect();
    assert!(files.len() > 20, "the source was not found: {files:?}");
    files
}

/// The modules that ship: all but the test kit and the demo built on it.
fn product_files() -> BTreeMap<String, PathBuf> {
    let mut files = module_files();
    files.retain(|module, _| ![TEST_KIT, DEMO].contains(&top(module)));
    files
}

fn crate_graph() -> Graph {
    let files = module_files();
    let modules: BTreeSet<String> = files.keys().cloned().collect();
    files
        .iter()
        .map(|(module, file)| {
            let code = strip_test_code(&std::fs::read_to_string(file).unwrap());
            (module.clone(), uses(&code, module, &modules))
        })
        .collect()
}

/// `telemetry/fds.rs` -> `telemetry::fds`, `telemetry/mod.rs` -> `telemetry`; the crate roots
/// `lib.rs` and `main.rs` only declare and start modules, so they are none.
fn module_path(relative: &Path) -> Option<String> {
    let mut parts: Vec<String> = relative
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|last| last == "mod") {
        parts.pop();
    }
    match parts.as_slice() {
        [only] if only == "lib" || only == "main" => None,
        _ => Some(parts.join("::")),
    }
}

fn top(module: &str) -> &str {
    module.split("::").next().unwrap()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
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

/// The modules other than `own` that `code` names, each resolved to the longest module path
/// the named path starts with.
fn uses(code: &str, own: &str, modules: &BTreeSet<String>) -> BTreeSet<String> {
    let own_path: Vec<&str> = own.split("::").collect();
    let children: BTreeSet<&str> = modules
        .iter()
        .filter_map(|m| m.strip_prefix(own)?.strip_prefix("::"))
        .filter(|rest| !rest.contains("::"))
        .collect();
    let mut found = BTreeSet::new();
    for (at, word) in path_starts(code) {
        let base: Vec<&str> = match word {
            "crate" => Vec::new(),
            "self" => own_path.clone(),
            "super" => own_path[..own_path.len().saturating_sub(1)].to_vec(),
            child if children.contains(child) => [own_path.as_slice(), &[child]].concat(),
            _ => continue,
        };
        let rest = &code[at + word.len() + "::".len()..];
        for named in use_tree(rest, &base) {
            if let Some(module) = (1..=named.len())
                .rev()
                .map(|n| named[..n].join("::"))
                .find(|prefix| modules.contains(prefix))
                && module != own
            {
                found.insert(module);
            }
        }
    }
    found
}

/// Each word that starts a path (`word::`, not preceded by `::` or part of a longer word), with
/// where it starts.
fn path_starts(code: &str) -> impl Iterator<Item = (usize, &str)> {
    let is_word = |c: char| c.is_alphanumeric() || c == '_';
    code.match_indices("::").filter_map(move |(end, _)| {
        let start = code[..end]
            .rfind(|c: char| !is_word(c))
            .map_or(0, |i| i + 1);
        let before = code[..start].trim_end();
        (start < end && !before.ends_with("::")).then(|| (start, &code[start..end]))
    })
}

/// The paths named by the use tree at the start of `text`, below `base`: `a::b`, `a::{b, c::d}`
/// with nested groups, and `self` in a group for the group's own path. `super` inside a path
/// climbs.
fn use_tree(text: &str, base: &[&str]) -> Vec<Vec<String>> {
    let mut path: Vec<String> = base.iter().map(|s| (*s).to_owned()).collect();
    let mut rest = text;
    loop {
        rest = rest.trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let inner = &group[..matching_brace(group)];
            let segments: Vec<&str> = path.iter().map(String::as_str).collect();
            return split_top_level(inner)
                .into_iter()
                .flat_map(|item| match item.trim() {
                    "self" => vec![path.clone()],
                    item => use_tree(item, &segments),
                })
                .collect();
        }
        let word_end = rest
            .find(|c: char| !c.is_alphanumeric() && c != '_')
            .unwrap_or(rest.len());
        match &rest[..word_end] {
            "" => return vec![path],
            "super" => {
                path.pop();
            }
            word => path.push(word.to_owned()),
        }
        match rest[word_end..].strip_prefix("::") {
            Some(next) => rest = next,
            None => return vec![path],
        }
    }
}

/// Where the group that `text` is the inside of closes.
fn matching_brace(text: &str) -> usize {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return i,
            '}' => depth -= 1,
            _ => {}
        }
    }
    text.len()
}

fn split_top_level(group: &str) -> Vec<&str> {
    let (mut items, mut depth, mut start) = (Vec::new(), 0usize, 0);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(&group[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&group[start..]);
    items.into_iter().filter(|i| !i.trim().is_empty()).collect()
}

/// The code without comments, string contents and `#[cfg(test)]` items, which may use anything.
fn strip_test_code(source: &str) -> String {
    strip_test_items(&strip_comments_and_strings(source))
}

fn strip_test_items(code: &str) -> String {
    let mut kept = String::with_capacity(code.len());
    let mut rest = code;
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

/// The modules on each floor, lowest first, for an acyclic graph.
fn floors(graph: &Graph) -> Vec<Vec<String>> {
    fn floor(module: &str, graph: &Graph, known: &mut BTreeMap<String, usize>) -> usize {
        if let Some(&floor) = known.get(module) {
            return floor;
        }
        let uses = graph.get(module).into_iter().flatten();
        let floor = uses
            .map(|next| floor(next, graph, known) + 1)
            .max()
            .unwrap_or(0);
        known.insert(module.to_owned(), floor);
        floor
    }
    let mut known = BTreeMap::new();
    let mut floors: Vec<Vec<String>> = Vec::new();
    for module in graph.keys() {
        let at = floor(module, graph, &mut known);
        if floors.len() <= at {
            floors.resize(at + 1, Vec::new());
        }
        floors[at].push(module.clone());
    }
    floors
}
