-- Argo CD health check for hsx.dev/v1alpha1 ExtractionJob.
-- Install it under resource.customizations.health.hsx.dev_ExtractionJob in argocd-cm
-- (see docs/guide.md, "GitOps"). Argo CD runs it with the live object in `obj`.
--
--   Succeeded -> Healthy, Failed -> Degraded, Suspended -> Suspended, anything else -> Progressing.
--
-- A status the operator wrote for an older generation says nothing about the current spec
-- (for example right after runId changed in Git), so it reads as Progressing until
-- status.observedGeneration catches up with metadata.generation.

local hs = {}

local function condition_message(status, wanted)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == wanted and c.status == "True" and c.message ~= nil and c.message ~= "" then
      return c.message
    end
  end
  return nil
end

local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the hsx operator to pick up this ExtractionJob"
  return hs
end

local generation = obj.metadata.generation
local observed = status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the hsx operator to observe generation " .. tostring(generation)
  return hs
end

local phase = status.phase
local message = condition_message(status, phase) or status.message
if phase == "Succeeded" then
  hs.status = "Healthy"
elseif phase == "Failed" then
  hs.status = "Degraded"
elseif phase == "Suspended" then
  hs.status = "Suspended"
else
  hs.status = "Progressing"
end
if message == nil or message == "" then
  message = "Phase " .. tostring(phase or "unknown")
end
hs.message = message
return hs
