#!/usr/bin/env bash
# modcheck.sh: keep the nested modules (every directory below the root with a
# go.mod, such as s3fetch) fetchable on their own.
#
# A nested module requires the core module at a pseudo-version of a commit of
# this repository, and keeps `replace github.com/streamq/streamq => ../` for
# development only: dependents ignore a dependency's replace directives, so
# without a real version they could not resolve the core module at all.
#
#   scripts/modcheck.sh pin     re-pin every nested module to HEAD's pseudo-version
#   scripts/modcheck.sh check   prove `go get <nested module>` works from a scratch
#                               module, offline, against a file:// module proxy
#                               built from this repository
#
# The check serves the core module at each pinned version (the files of that
# commit) and each nested module at HEAD's pseudo-version (its files in the
# working tree, uncommitted edits of tracked files included). Third-party
# modules come from the local module cache, used as a second file:// proxy, so
# no network is used; a module missing from the cache makes the check fail.
set -euo pipefail

CORE=github.com/streamq/streamq
PLACEHOLDER=v0.0.0-00010101000000-000000000000
GO=${GO:-go}

root=$(git rev-parse --show-toplevel)
cd "$root"

# pseudo REV: the pseudo-version of commit REV (v0.0.0-<UTC commit time>-<12 hex>).
pseudo() {
	local t h
	t=$(TZ=UTC git show -s --format=%cd --date=format-local:%Y%m%d%H%M%S "$1")
	h=$(git rev-parse --short=12 "$1^{commit}")
	echo "v0.0.0-$t-$h"
}

# nested_modules: the directories (relative, no ./) of the nested modules.
nested_modules() {
	find . -name go.mod -not -path ./go.mod -not -path '*/testdata/*' -not -path '*/vendor/*' -not -path './.*' |
		sed -e 's|^\./||' -e 's|/go.mod$||' | sort
}

# required_core DIR: the version of the core module DIR/go.mod requires (empty if none).
required_core() {
	(cd "$1" && "$GO" mod edit -json) | awk -v core="\"$CORE\"" '
		$1 == "\"Path\":" && $2 == core"," { want = 1; next }
		want && $1 == "\"Version\":" { gsub(/[",]/, "", $2); print $2; exit }
		{ want = 0 }'
}

# required_siblings DIR: "path version" of each nested module of this
# repository that DIR/go.mod requires (an example module using two others).
required_siblings() {
	(cd "$1" && "$GO" mod edit -json) | awk -v core="$CORE" '
		$1 == "\"Path\":" { gsub(/[",]/, "", $2); path = $2; next }
		$1 == "\"Version\":" && index(path, core "/") == 1 { gsub(/[",]/, "", $2); print path, $2 }
		{ path = "" }'
}

# module_path DIR: the module path declared in DIR/go.mod.
module_path() {
	awk '$1 == "module" { print $2; exit }' "$1/go.mod"
}

cmd_pin() {
	local v dir path old
	v=$(pseudo HEAD)
	for dir in $(nested_modules); do
		(cd "$dir" && "$GO" mod edit -require="$CORE@$v")
		echo "$dir: $CORE $v"
		while read -r path old; do
			[ -n "$path" ] || continue
			(cd "$dir" && "$GO" mod edit -require="$path@$v")
			echo "$dir: $path $v"
		done < <(required_siblings "$dir")
	done
	echo "pinned to HEAD ($v); commit the go.mod files. Pin to a commit that is on main:"
	echo "dependents resolve the core module at that commit. A nested module that"
	echo "requires another (an example) resolves it at that commit too, whose go.mod"
	echo "must itself be pinned: after pinning for the first time, commit, then run"
	echo "\`make pin\` once more and commit again."
}

# add_version MODPATH VERSION ZIP GOMOD TIME: put one module version into the proxy.
proxy=""
tmp=""
add_version() {
	local modpath=$1 version=$2 zip=$3 gomod=$4 time=$5 d
	d="$proxy/$modpath/@v"
	mkdir -p "$d"
	cp "$zip" "$d/$version.zip"
	cp "$gomod" "$d/$version.mod"
	printf '{"Version":"%s","Time":"%s"}\n' "$version" "$time" >"$d/$version.info"
	echo "$version" >>"$d/list"
}

# archive REV SUBDIR MODPATH VERSION OUT: a module zip of REV's SUBDIR ("" for
# the root), without the directories of modules nested in it.
archive() {
	local rev=$1 sub=$2 modpath=$3 version=$4 out=$5 excl=() m
	for m in $(git ls-tree -r --name-only "$rev" -- ${sub:+"$sub/"} | grep '/go.mod$' | grep -v '/testdata/' | sed 's|/go.mod$||'); do
		[ "$m" = "$sub" ] && continue
		excl+=(":(exclude)${m#"${sub:+$sub/}"}")
	done
	if [ -n "$sub" ]; then
		(cd "$root/$sub" && git archive --format=zip --prefix="$modpath@$version/" -o "$out" "$rev" -- . "${excl[@]}")
	else
		git archive --format=zip --prefix="$modpath@$version/" -o "$out" "$rev" -- . "${excl[@]}"
	fi
}

cmd_check() {
	local dirs dir req hash full t headv snap modpath fails=0 pinned=() siblings=() p sib
	dirs=$(nested_modules)
	[ -n "$dirs" ] || { echo "modcheck: no nested modules"; return 0; }

	# 1. Every nested module pins the core module at a real commit of this repository.
	for dir in $dirs; do
		req=$(required_core "$dir")
		if [ -z "$req" ]; then
			echo "modcheck: $dir does not require $CORE; nothing to pin"
			continue
		fi
		if [ "$req" = "$PLACEHOLDER" ]; then
			echo "modcheck: FAIL $dir requires $CORE at the placeholder $PLACEHOLDER," >&2
			echo "  which dependents cannot resolve: run \`make pin\` on a commit of main and commit $dir/go.mod" >&2
			fails=1
			continue
		fi
		hash=${req##*-}
		if ! full=$(git rev-parse -q --verify "$hash^{commit}" 2>/dev/null); then
			echo "modcheck: FAIL $dir requires $CORE $req: no commit $hash in this repository; run \`make pin\`" >&2
			fails=1
			continue
		fi
		if [ "$(pseudo "$full")" != "$req" ]; then
			echo "modcheck: FAIL $dir requires $CORE $req, but that commit's pseudo-version is $(pseudo "$full"); run \`make pin\`" >&2
			fails=1
			continue
		fi
		if ! git merge-base --is-ancestor "$full" HEAD; then
			echo "modcheck: FAIL $dir requires $CORE $req, a commit that is not in HEAD's history; run \`make pin\`" >&2
			fails=1
			continue
		fi
		echo "modcheck: $dir requires $CORE $req"
		pinned+=("$full")
		while read -r sib req; do
			[ -n "$sib" ] || continue
			hash=${req##*-}
			if [ "$req" = "$PLACEHOLDER" ] || ! full=$(git rev-parse -q --verify "$hash^{commit}" 2>/dev/null) ||
				[ "$(pseudo "$full")" != "$req" ] || ! git merge-base --is-ancestor "$full" HEAD; then
				echo "modcheck: FAIL $dir requires $sib $req, not a commit in HEAD's history: run \`make pin\`, commit, and run it once more (see pin)" >&2
				fails=1
				continue
			fi
			if [ "$(git show "$full:${sib#"$CORE/"}/go.mod" 2>/dev/null | awk -v core="$CORE" '$1 == core { print $2 } $1 == "require" && $2 == core { print $3 }' | head -1)" = "$PLACEHOLDER" ]; then
				echo "modcheck: FAIL $dir requires $sib $req, whose go.mod at that commit requires $CORE at the placeholder: run \`make pin\` again and commit" >&2
				fails=1
				continue
			fi
			echo "modcheck: $dir requires $sib $req"
			siblings+=("$sib $req $full")
		done < <(required_siblings "$dir")
	done
	[ "$fails" = 0 ] || return 1

	tmp=$(mktemp -d)
	trap 'chmod -R u+w "$tmp" 2>/dev/null; rm -rf "$tmp"' EXIT
	proxy="$tmp/proxy"
	mkdir -p "$proxy"

	# 2. The core module at each pinned commit. Its requirements are first
	# fetched into the local module cache (a no-op when they are there already).
	for p in $(printf '%s\n' "${pinned[@]}" | sort -u); do
		req=$(pseudo "$p")
		t=$(TZ=UTC git show -s --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ "$p")
		archive "$p" "" "$CORE" "$req" "$tmp/core.zip"
		git show "$p:go.mod" >"$tmp/core.mod"
		add_version "$CORE" "$req" "$tmp/core.zip" "$tmp/core.mod" "$t"
		mkdir -p "$tmp/warm-$req"
		git archive "$p" go.mod go.sum | tar -x -C "$tmp/warm-$req"
		(cd "$tmp/warm-$req" && GOFLAGS=-mod=mod GOWORK=off "$GO" mod download)
	done

	# 2b. Nested modules that other nested modules require, each at the commit
	# its pseudo-version names.
	for p in "${siblings[@]}"; do
		read -r sib req full <<<"$p"
		t=$(TZ=UTC git show -s --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ "$full")
		archive "$full" "${sib#"$CORE/"}" "$sib" "$req" "$tmp/sib.zip"
		git show "$full:${sib#"$CORE/"}/go.mod" >"$tmp/sib.mod"
		add_version "$sib" "$req" "$tmp/sib.zip" "$tmp/sib.mod" "$t"
	done

	# 3. Each nested module at HEAD's pseudo-version, from the working tree.
	headv=$(pseudo HEAD)
	t=$(TZ=UTC git show -s --format=%cd --date=format-local:%Y-%m-%dT%H:%M:%SZ HEAD)
	# A commit object of the working tree (none when it is clean); the
	# identity is only for that object, which nothing references.
	snap=$(git -c user.name=modcheck -c user.email=modcheck@localhost stash create)
	snap=${snap:-HEAD}
	for dir in $dirs; do
		[ -n "$(required_core "$dir")" ] || continue
		modpath=$(module_path "$dir")
		archive "$snap" "$dir" "$modpath" "$headv" "$tmp/mod.zip"
		cp "$dir/go.mod" "$tmp/mod.mod"
		add_version "$modpath" "$headv" "$tmp/mod.zip" "$tmp/mod.mod" "$t"
	done

	# 4. From a scratch module, offline: go get each nested module and build it.
	local cache
	cache=$("$GO" env GOMODCACHE)
	for dir in $dirs; do
		[ -n "$(required_core "$dir")" ] || continue
		modpath=$(module_path "$dir")
		rm -rf "$tmp/scratch"
		mkdir -p "$tmp/scratch"
		echo "modcheck: go get $modpath@$headv from a scratch module (GOPROXY=file://..., no network)"
		(
			cd "$tmp/scratch"
			export GOPROXY="file://$proxy,file://$cache/cache/download" GOSUMDB=off GONOSUMDB="$CORE" \
				GOFLAGS=-mod=mod GOWORK=off GOTOOLCHAIN=local GOMODCACHE="$tmp/modcache"
			# Chained with &&: set -e does not apply inside a subshell
			# whose status the || below tests, so a failed build went
			# unnoticed and the check said ok.
			"$GO" mod init example.com/scratch >/dev/null 2>&1 &&
				"$GO" get "$modpath@$headv" &&
				"$GO" build -trimpath "$modpath/..." &&
				"$GO" list -m "$CORE" "$modpath"
		) || {
			echo "modcheck: FAIL go get $modpath did not work from a separate module" >&2
			fails=1
		}
	done
	[ "$fails" = 0 ] || return 1
	echo "modcheck: ok"
}

case "${1:-check}" in
pin) cmd_pin ;;
check) cmd_check ;;
*)
	echo "usage: $0 pin|check" >&2
	exit 2
	;;
esac
