// Package scripts holds the Lua scripts that make each multi-step change to a
// queue atomic. Each .lua file starts with a header naming its KEYS, ARGV and
// reply; all KEYS of one call belong to one queue, so one hash slot.
package scripts

import (
	_ "embed"
	"strings"

	"github.com/redis/go-redis/v9"
)

var (
	//go:embed produce.lua
	produceSrc string
	//go:embed complete.lua
	completeSrc string
	//go:embed claim.lua
	claimSrc string
	//go:embed lease.lua
	leaseSrc string
	//go:embed trim.lua
	trimSrc string
	//go:embed prune.lua
	pruneSrc string
	//go:embed requeue.lua
	requeueSrc string
	//go:embed resume.lua
	resumeSrc string
	//go:embed charge.lua
	chargeSrc string
	//go:embed release.lua
	releaseSrc string
	//go:embed adopt.lua
	adoptSrc string
	//go:embed job.lua
	jobSrc string
	//go:embed forget.lua
	forgetSrc string
	//go:embed entrystream.lua
	entryStreamSrc string
	//go:embed ratelimit.lua
	rateLimitSrc string
	//go:embed periodic.lua
	periodicSrc string
	//go:embed promote.lua
	promoteSrc string
	//go:embed retry.lua
	retrySrc string
	//go:embed cancel.lua
	cancelSrc string
	//go:embed jobs.lua
	jobsSrc string
	//go:embed flowrelease.lua
	flowReleaseSrc string
	//go:embed flow.lua
	flowSrc string
	//go:embed progress.lua
	progressSrc string
	//go:embed hear.lua
	hearSrc string
	//go:embed payload.lua
	payloadSrc string
	//go:embed cancelretry.lua
	cancelRetrySrc string
	//go:embed purge.lua
	purgeSrc string
	//go:embed fair.lua
	fairSrc string
	//go:embed fairadmin.lua
	fairAdminSrc string
)

// The scripts. Run uses EVALSHA and falls back to EVAL when the server lacks the script.
var (
	Produce  = redis.NewScript(produceFull)
	Complete = redis.NewScript(completeFull)
	Claim    = redis.NewScript(claimSrc)
	Lease    = redis.NewScript(leaseSrc)
	Trim     = redis.NewScript(trimSrc)
	Prune    = redis.NewScript(pruneSrc)
	Requeue  = redis.NewScript(fairSrc + requeueSrc)
	Resume   = redis.NewScript(resumeSrc)
	Charge   = redis.NewScript(chargeSrc)
	Release  = redis.NewScript(releaseSrc)
	Adopt    = redis.NewScript(adoptSrc)
	Job      = redis.NewScript(entryStreamSrc + jobSrc)
	Forget   = redis.NewScript(entryStreamSrc + fairSrc + forgetSrc)
	// RateLimit takes tokens of a shared rate limit (GCRA on the server's clock).
	RateLimit = redis.NewScript(rateLimitSrc)
	// Periodic records a periodic job's last and next slot.
	Periodic = redis.NewScript(periodicSrc)
	Promote  = redis.NewScript(fairSrc + promoteSrc)
	Retry    = redis.NewScript(fairSrc + retrySrc)
	Cancel   = redis.NewScript(fairSrc + flowReleaseSrc + cancelSrc)
	// Jobs reads one shard's part of an Admin.Jobs page.
	Jobs = redis.NewScript(jobsSrc)
	// Flow produces a parent with its children (fair.lua and
	// flowrelease.lua in front).
	Flow = redis.NewScript(fairSrc + flowReleaseSrc + flowSrc)
	// Progress stores and announces a handler's progress value.
	Progress = redis.NewScript(progressSrc)
	// Hear makes quiet records announced, for a producer that listens now.
	Hear = redis.NewScript(hearSrc)
	// EntryPayload reads the start of one entry's payload.
	EntryPayload = redis.NewScript(payloadSrc)
	// CancelRetry cancels a fan-out group's waiting retry.
	CancelRetry = redis.NewScript(cancelRetrySrc)
	// Purge deletes a dead-letter stream and counts it, in one step.
	Purge = redis.NewScript(purgeSrc)
	// FairAdmin reads and changes one shard's keys (fair queuing by key).
	FairAdmin = redis.NewScript(fairSrc + fairAdminSrc)
)

// fairMarker is the line of produce.lua where fair.lua's functions go: after
// the plain form, which never meets a keyed item, so that form runs exactly
// as it would without keys.
const fairMarker = "-- fair.lua goes here\n"

// The sources of the scripts that Heads call too (see call.go).
var (
	produceFull  = withFair(produceSrc)
	completeFull = lazyLib("completeLib", fairSrc+flowReleaseSrc) + completeSrc
)

// lazyLib wraps fair.lua and flowrelease.lua (lib) in a function named
// name, which returns fairRelease, flowLib and a setter of fairPub. A script
// that calls it only when an item needs it (complete.lua: a keyed item, a
// flow's child or dead letter) does not make lib's closures, about twenty,
// on every call.
func lazyLib(name, lib string) string {
	return "local function " + name + "()\n" + lib +
		"\nreturn fairRelease, flowLib, function(pub) fairPub = pub end\nend\n"
}

// withFair puts fair.lua at src's marker, wrapped in fairLib, which returns
// the functions produce.lua uses and a setter of fairPub: only a call with
// keyed items calls it, so the other calls of the general path (batches)
// do not make fair.lua's closures either.
func withFair(src string) string {
	if !strings.Contains(src, fairMarker) {
		panic("scripts: produce.lua lost its fair.lua marker")
	}
	lib := "local function fairLib()\n" + fairSrc + "\nreturn fairBase, fairKeyOf, fairMayAppend, fairWait, fairEnc, fairTake, " +
		"function(pub) fairPub = pub end\nend\n"
	return strings.Replace(src, fairMarker, lib, 1)
}
